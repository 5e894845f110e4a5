"""The data pipeline: corpus, tokenizer, token cache, segments, windows and the LightningDataModule.

corpus (stdlib | files | hf:NAME) -> documents -> split by document (seeded) -> sentencepiece trained on the
training documents -> every document as [bos] + ids + [eos] in one memory-mapped array, cached under
$RLM_CACHE -> global segments of segment_len tokens -> windows of seq_len tokens at offsets 0, seq_len, ...
of each document -> batches, a dict of tensors:

  tokens       (B, T) long   input ids, pad_id (0) past the document's end
  targets      (B, T) long   next-token ids, -100 where there is none
  mask         (B, T) bool   True at real input tokens
  segment_ids  (B, T // segment_len) long   global ids of the window's segments, -1 for all-padding ones
  doc_ids      (B,) long     document of each row
  starts       (B,) long     offset of the window inside its document (a multiple of seq_len)

and, once on a device, host: the loader's host tensors of those fields (rlm.data.windows.host_copy).

Core layer: imports nothing of rlm but rlm.extras. This package imports none of its modules, so reading a token
array does not import Lightning.
"""
