"""The data pipeline: corpus -> documents -> split by document (seeded) -> a sentencepiece model trained on the
training documents -> every document as [bos] + ids + [eos] in one memory-mapped array cached under $RLM_CACHE ->
segments of segment_len tokens -> windows of seq_len tokens at offsets 0, seq_len, ... of each document -> batches:

  tokens (B, T) long: input ids, pad_id past the document's end; targets (B, T) long: next-token ids, -100 where
  there is none; mask (B, T) bool: real input tokens; segment_ids (B, T // segment_len) long: global ids of the
  window's segments, -1 for all-padding ones; doc_ids (B,) long; starts (B,) long: the window's offset in its
  document; and once on a device, host: the loader's host tensors of those fields (windows.host_copy).

Core layer: imports nothing of rlm but rlm.extras; this package imports none of its modules, so reading a token
array does not import Lightning.
"""
