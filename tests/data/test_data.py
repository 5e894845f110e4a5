"""rlm.data: corpus reading, tokenizer cache, segments, windows, sharding and exact resume under Lightning."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.callbacks import ModelCheckpoint

from rlm.data.corpus import read_corpus, stdlib_paths
from rlm.data.module import RLMDataModule
from rlm.data.segments import SegmentTable
from rlm.data.store import TokenStore, split_train_val_test
from rlm.data.tokenizer import Tokenizer
from rlm.data.windows import IGNORE_INDEX, TrainLoader

SEQ, SEG = 32, 8


def _write_corpus(root, n_docs=24, seed=0):
    """ASCII documents of pseudo-random words, lengths from a few words to a few hundred."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for d in range(n_docs):
        n_words = int(rng.integers(3, 300))
        words = ["".join(rng.choice(letters, int(rng.integers(1, 8)))) for _ in range(n_words)]
        lines = [" ".join(words[i : i + 9]) for i in range(0, n_words, 9)]
        texts[f"doc{d:03d}.txt"] = "\n".join(lines) + "\n"
        (root / f"doc{d:03d}.txt").write_text(texts[f"doc{d:03d}.txt"])
    return texts


def _dm(corpus, cache, **kw):
    args = dict(vocab_size=300, seq_len=SEQ, segment_len=SEG, batch_size=4, val_fraction=0.2, progress=False)
    return RLMDataModule(corpus=str(corpus), cache_dir=str(cache), **{**args, **kw})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, _write_corpus(root)


@pytest.fixture(scope="module")
def dm(corpus, tmp_path_factory):
    module = _dm(corpus[0], tmp_path_factory.mktemp("cache"))
    module.prepare_data()
    module.setup("fit")
    return module


# ---- split, cache, round trip --------------------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_complete():
    train, val = split_train_val_test(100, 0.2, 0.0, seed=3)[:2]
    again = split_train_val_test(100, 0.2, 0.0, seed=3)[:2]
    other = split_train_val_test(100, 0.2, 0.0, seed=4)[:2]
    assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
    assert not np.array_equal(val, other[1])
    assert len(val) == 20 and not set(train) & set(val) and sorted({*train, *val}) == list(range(100))
    assert (
        len(split_train_val_test(3, 0.01, 0.0, 0)[1]) == 1
    )  # a nonzero fraction holds out at least one document


def test_store_round_trip(dm, corpus):
    store, tok = dm.store, dm.tokenizer
    names = sorted(corpus[1])
    assert store.names == names  # relative to the corpus directory
    assert store.tokens.dtype == np.uint16 and isinstance(store.tokens, np.memmap)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3) and dm.vocab_size == 300
    for d, name in enumerate(names):
        ids = store.doc_tokens(d)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids[1:-1]) == corpus[1][name] == dm.text_of(d)
        assert ids[1:-1].tolist() == tok.encode(corpus[1][name])
    assert store.doc_offsets[0] == 0 and store.doc_offsets[-1] == len(store.tokens)
    train, val, test = set(store.train_docs), set(store.val_docs), set(store.test_docs)
    assert test and not train & val and not train & test and not val & test
    assert sorted(train | val | test) == list(range(len(names)))


def test_tokenizer_encodes_any_text(dm):
    text = "déjà vu ☃ \t\n  x = 1\r\n"  # none of these characters is in the ASCII training corpus
    assert dm.tokenizer.decode(dm.tokenizer.encode(text)) == text
    assert dm.decode(torch.tensor([[2, *dm.tokenizer.encode("ab")], [3, 0, IGNORE_INDEX]])) == "ab"
    assert _dm(".", ".", vocab_size=1000).vocab_size == 1000  # known before setup, for argument links


def test_cache_is_reused(dm, corpus, monkeypatch):
    model = dm.cache_path() / "tokenizer.model"
    mtime = model.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(Tokenizer, "train", no_training)
    again = _dm(corpus[0], dm.cache_dir)
    again.prepare_data()
    again.setup()
    assert again.cache_path() == dm.cache_path() and model.stat().st_mtime_ns == mtime
    assert again.fingerprint == dm.fingerprint
    assert _dm(corpus[0], dm.cache_dir, seed=1).cache_key() != dm.cache_key()  # another split, another entry
    assert (
        _dm(corpus[0], dm.cache_dir, segment_len=4).cache_path() == dm.cache_path()
    )  # segments are not cached


# ---- segments and windows ------------------------------------------------------------------------------
def test_segment_table_matches_documents(dm):
    seg, store = dm.segments, dm.store
    assert isinstance(seg, SegmentTable) and seg.segment_len == SEG
    ids = []
    for d in range(store.n_docs):
        doc = store.doc_tokens(d)
        r = seg.doc_segments(d)
        ids.extend(r)
        assert len(r) == -(-len(doc) // SEG)
        for k, s in enumerate(r):
            assert seg.doc[s] == d and seg.start[s] == store.doc_offsets[d] + k * SEG
            assert seg.length[s] == min(SEG, len(doc) - k * SEG)
            expected = np.zeros(SEG, dtype=np.int64)
            expected[: seg.length[s]] = doc[k * SEG : (k + 1) * SEG]
            np.testing.assert_array_equal(seg.tokens(np.array([s]))[0], expected)
    assert ids == list(range(len(seg)))  # global ids, contiguous per document, in document order
    np.testing.assert_array_equal(seg.start - store.doc_offsets[seg.doc], seg.offset)
    train_ids = seg.ids_of_docs(store.train_docs)
    assert train_ids.tolist() == [s for d in store.train_docs for s in seg.doc_segments(d)]


def _expected_row(store, seg, doc, start):
    """Brute-force window: tokens/targets/mask/segment ids for one (doc, start)."""
    toks = store.doc_tokens(doc).astype(np.int64)
    tokens, targets, mask = np.zeros(SEQ, np.int64), np.full(SEQ, IGNORE_INDEX), np.zeros(SEQ, bool)
    for t in range(SEQ):
        if start + t < len(toks):
            tokens[t], mask[t] = toks[start + t], True
        if start + t + 1 < len(toks):
            targets[t] = toks[start + t + 1]
    segs = [
        seg.doc_segments(doc)[start // SEG + j] if start + j * SEG < len(toks) else -1
        for j in range(SEQ // SEG)
    ]
    return tokens, targets, mask, np.array(segs)


def test_windows_cover_documents_and_match_brute_force(dm):
    store, seg = dm.store, dm.segments
    for split, docs in [("train", store.train_docs), ("val", store.val_docs)]:
        w = dm.windows(split)
        expected = [(d, s) for d in docs for s in range(0, len(store.doc_tokens(d)) - 1, SEQ)]
        assert list(zip(w.doc.tolist(), w.start.tolist())) == expected
        batch = w.collate(np.arange(len(w)))
        assert batch["tokens"].dtype == torch.long and batch["mask"].dtype == torch.bool
        for i, (d, s) in enumerate(expected):
            tokens, targets, mask, segs = _expected_row(store, seg, d, s)
            assert batch["doc_ids"][i] == d and batch["starts"][i] == s
            np.testing.assert_array_equal(batch["tokens"][i].numpy(), tokens)
            np.testing.assert_array_equal(batch["targets"][i].numpy(), targets)
            np.testing.assert_array_equal(batch["mask"][i].numpy(), mask)
            np.testing.assert_array_equal(batch["segment_ids"][i].numpy(), segs)
            # the segments' own tokens are the window's tokens, segment by segment
            real = segs >= 0
            np.testing.assert_array_equal(
                seg.tokens(segs[real]).reshape(-1), tokens.reshape(-1, SEG)[real].reshape(-1)
            )


def test_last_window_is_padded(dm):
    w, store = dm.windows("train"), dm.store
    left = (
        np.diff(store.doc_offsets)[w.doc] - w.start
    )  # tokens from each window's start to its document's end
    i = int(np.flatnonzero((left > 1) & (left <= SEQ - SEG))[0])  # a last window with an all-padding segment
    n = int(left[i])
    b = w.collate([i])
    assert b["mask"][0, :n].all() and not b["mask"][0, n:].any()
    assert (b["tokens"][0, n:] == 0).all() and b["tokens"][0, n - 1] == dm.tokenizer.eos_id
    assert (b["targets"][0, : n - 1] >= 0).all() and (b["targets"][0, n - 1 :] == IGNORE_INDEX).all()
    assert b["targets"][0, n - 2] == dm.tokenizer.eos_id
    assert (b["segment_ids"][0, -(-n // SEG) :] == -1).all() and (
        b["segment_ids"][0, : -(-n // SEG)] >= 0
    ).all()


# ---- loaders -------------------------------------------------------------------------------------------
def _keys(batches):
    return [tuple(zip(b["doc_ids"].tolist(), b["starts"].tolist())) for b in batches]


def test_train_loader_shards_evenly_and_reshuffles(dm):
    w = dm.windows("train")
    for world in (1, 2, 3):
        loaders = [TrainLoader(w, 4, seed=0, rank=r, world_size=world) for r in range(world)]
        assert len({len(x) for x in loaders}) == 1 and len(loaders[0]) == len(w) // (4 * world)
        seen = [k for x in loaders for b in _keys(x) for k in b]
        assert len(seen) == len(set(seen)) == len(loaders[0]) * 4 * world  # disjoint, remainder dropped
    loader = TrainLoader(w, 4, seed=0)
    first, second = _keys(loader), _keys(loader)  # a second pass is the next epoch
    assert loader.epoch == 1 and first != second and sorted(first) != first
    assert _keys(TrainLoader(w, 4, seed=0)) == first and _keys(TrainLoader(w, 4, seed=1)) != first
    with pytest.raises(ValueError, match="rank=2 with world_size=2"):
        TrainLoader(w, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="fewer than batch_size=1000"):
        TrainLoader(w, 1000)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_upcoming_is_the_batch_the_loader_hands_out_next(dm, num_workers):
    """Across an epoch's end, and after a resume from the loader's state."""
    loader = TrainLoader(dm.windows("train"), 4, seed=0, num_workers=num_workers)
    epochs = iter(loader), iter(loader)  # generators: the second starts once the first is used up
    for i in range(len(loader) + 2):
        ahead = loader.upcoming()
        batch = next(epochs[i // len(loader)])
        assert batch.keys() == ahead.keys()
        for name, x in batch.items():
            torch.testing.assert_close(ahead[name], x, rtol=0, atol=0, msg=name)
    assert loader.epoch == 1
    resumed = TrainLoader(dm.windows("train"), 4, seed=0)
    resumed.load_state_dict(loader.state_dict())
    torch.testing.assert_close(resumed.upcoming()["tokens"], next(iter(loader))["tokens"], rtol=0, atol=0)


def test_datamodule_shards_by_the_attached_trainer(dm, monkeypatch):
    per_rank = []
    for rank in range(3):
        cpu = SimpleNamespace(root_device=torch.device("cpu"))
        trainer = SimpleNamespace(global_rank=rank, world_size=3, current_epoch=2, strategy=cpu)
        monkeypatch.setattr(dm, "trainer", trainer)
        loader = dm.train_dataloader()
        assert (loader.rank, loader.world_size, loader.epoch) == (rank, 3, 2)
        per_rank.append([k for b in _keys(loader) for k in b])
    assert len({len(keys) for keys in per_rank}) == 1
    assert not set(per_rank[0]) & set(per_rank[1]) and not set(per_rank[1]) & set(per_rank[2])


def test_no_validation_documents(corpus, tmp_path):
    module = _dm(corpus[0], tmp_path, val_fraction=0.0, test_fraction=0.0)
    module.setup()
    assert len(module.store.val_docs) == 0 and module.val_dataloader() == []
    assert len(module.store.train_docs) == len(corpus[1])
    with pytest.raises(ValueError, match="test split is empty"):
        module.test_dataloader()


def test_three_way_split_is_deterministic_disjoint_and_keeps_the_validation_documents():
    train, val, test = split_train_val_test(100, 0.2, 0.1, seed=3)
    assert len(val) == 20 and len(test) == 10 and len(train) == 70
    assert sorted({*train, *val, *test}) == list(range(100)) and not set(val) & set(test)
    again = split_train_val_test(100, 0.2, 0.1, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((train, val, test), again))
    assert not np.array_equal(test, split_train_val_test(100, 0.2, 0.1, seed=4)[2])
    # The validation documents are those of the two-way split: adding a test split leaves them alone.
    assert np.array_equal(val, split_train_val_test(100, 0.2, 0.0, seed=3)[:2][1])
    assert [len(p) for p in split_train_val_test(3, 0.01, 0.01, 0)] == [1, 1, 1]
    assert [len(p) for p in split_train_val_test(2, 0.5, 0.5, 0)] == [1, 1, 0]  # one document stays to train


def test_test_loader_reads_the_test_documents(dm):
    batch = next(iter(dm.test_dataloader()))
    assert set(batch["doc_ids"].tolist()) <= set(dm.store.test_docs.tolist())
    assert len(dm.windows("test")) and not set(dm.windows("test").doc) & set(dm.windows("val").doc)


def test_state_dict_carries_the_tokenizer(dm):
    assert dm.state_dict()["tokenizer_model"] == open(dm.tokenizer.path, "rb").read()


def test_a_given_tokenizer_is_used_instead_of_training_one(dm, tmp_path, corpus):
    other = tmp_path / "other"
    other.mkdir()
    (other / "new.txt").write_text("brand new text, never seen\n")
    module = _dm(other, tmp_path / "cache", tokenizer=dm.tokenizer.path, val_fraction=0.0, test_fraction=0.0)
    module.prepare_data()
    store = TokenStore(module.cache_path())
    assert open(store.tokenizer.path, "rb").read() == open(dm.tokenizer.path, "rb").read()
    assert store.doc_tokens(0)[1:-1].tolist() == dm.tokenizer.encode("brand new text, never seen\n")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _dm(other, tmp_path, tokenizer=str(tmp_path / "missing.model"))


def test_train_loader_state_round_trip(dm):
    w = dm.windows("train")
    full = _keys(TrainLoader(w, 4, seed=5))
    loader = TrainLoader(w, 4, seed=5)
    it = iter(loader)
    head = _keys([next(it) for _ in range(3)])
    resumed = TrainLoader(w, 4, seed=5)
    resumed.load_state_dict(loader.state_dict())
    assert head + _keys(resumed) == full
    with pytest.raises(ValueError, match=r"batch_size=4 x world_size=1 = 4 windows, this run's is .* = 8; .*"
                       r"on 2 process\(es\) with the same batches, set --data.batch_size=2"):  # fmt: skip
        TrainLoader(w, 4, seed=5, world_size=2).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="checkpoint has seed=5, this run has seed=6"):
        TrainLoader(w, 4, seed=6).load_state_dict(loader.state_dict())


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4)])
def test_resuming_on_another_process_count_keeps_the_global_batches(dm, before, after):
    """Issue 24: a checkpoint of a 2-process run resumed on 1 process (batch_size doubled) trains on the same
    windows at every step as the run that was not interrupted."""
    w, glob = dm.windows("train"), 8

    def loaders(world):
        return [TrainLoader(w, glob // world, seed=3, rank=r, world_size=world) for r in range(world)]

    def steps(ranks, n):  # the set of windows of each global batch
        its = [iter(x) for x in ranks]
        return [sorted(k for it in its for k in _keys([next(it)])[0]) for _ in range(n)]

    straight = steps(loaders(before), 5)
    first = loaders(before)
    head = steps(first, 2)
    resumed = loaders(after)
    for x in resumed:
        x.load_state_dict(first[0].state_dict())  # the checkpoint holds rank 0's loader state
    assert head + steps(resumed, 3) == straight
    assert all(len(b) == glob for b in straight)


# slow: starts DataLoader worker processes
@pytest.mark.slow
def test_workers_give_the_same_batches(corpus, dm):
    with_workers = _dm(corpus[0], dm.cache_dir, num_workers=1)
    with_workers.setup()
    assert _keys(with_workers.train_dataloader()) == _keys(dm.train_dataloader())
    got, want = list(with_workers.val_dataloader()), list(dm.val_dataloader())
    assert len(got) == len(want) and all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, want))


class _Recorder(pl.LightningModule):
    """Records which windows each training step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple] = []  # one tuple of (doc, start) per batch

    def training_step(self, batch, batch_idx):
        self.seen.extend(_keys([batch]))
        return (self.w * batch["tokens"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(corpus, cache, batch_size, steps, ckpt_in=None, ckpt_out=None, every_step_to=None, **trainer_kw):
    """Fit a recorder; save a checkpoint at the end (ckpt_out) and/or after every step (into every_step_to)."""
    every = (
        [ModelCheckpoint(every_step_to, "{step}", save_top_k=-1, every_n_train_steps=1)]
        if every_step_to
        else []
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        callbacks=every,
        enable_checkpointing=bool(every),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer_kw,
    )
    model = _Recorder()
    # No test split: the training windows then divide into whole epochs of batches (see the caller).
    data = _dm(corpus, cache, batch_size=batch_size, test_fraction=0.0)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return model.seen


# slow: trains a model in-process for enough steps to check what it learned or saved
@pytest.mark.slow
def test_resume_mid_epoch_is_exact_with_a_real_trainer(corpus, dm, tmp_path):
    """2N steps in one go == N steps, checkpoint, resume; with checkpoints saved during training by
    ModelCheckpoint and by trainer.save_checkpoint after a run stopped by max_steps."""
    per_epoch = 4  # batches per epoch, so that a few steps cross an epoch boundary
    data = _dm(corpus[0], dm.cache_dir, test_fraction=0.0)
    data.setup()
    bs = len(data.windows("train")) // per_epoch
    assert len(data.windows("train")) % bs == 0  # whole epochs: every epoch covers the same windows
    total = 2 * per_epoch + 1
    straight = _fit(corpus[0], dm.cache_dir, bs, total, every_step_to=tmp_path)
    epoch0, epoch1 = straight[:per_epoch], straight[per_epoch : 2 * per_epoch]
    assert len(straight) == total and epoch0 != epoch1  # each entry is one batch; epochs are reshuffled
    assert sorted(k for b in epoch0 for k in b) == sorted(k for b in epoch1 for k in b)
    for first in (3, 4, 6):  # mid-epoch, exactly at the epoch's end, into the second epoch
        tail = _fit(corpus[0], dm.cache_dir, bs, total, ckpt_in=tmp_path / f"step={first}.ckpt")
        assert straight[:first] + tail == straight, f"resumed from the ModelCheckpoint of step {first}"
        ckpt = tmp_path / f"stopped{first}.ckpt"
        head = _fit(corpus[0], dm.cache_dir, bs, first, ckpt_out=ckpt)
        tail = _fit(corpus[0], dm.cache_dir, bs, total, ckpt_in=ckpt)
        assert head + tail == straight, f"resumed after max_steps={first}"
    reloaded = _fit(corpus[0], dm.cache_dir, bs, total, reload_dataloaders_every_n_epochs=1)
    assert reloaded == straight  # a new loader each epoch starts at the trainer's epoch


# ---- corpora -------------------------------------------------------------------------------------------
def test_hf_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"row {i} " + "lorem ipsum dolor sit amet " * (i + 1) for i in range(6)] + [""]
    datasets.Dataset.from_dict({"body": texts, "n": list(range(7))}).save_to_disk(str(tmp_path / "ds"))
    docs = read_corpus(f"hf:{tmp_path / 'ds'}", text_field="body", progress=False)
    assert [d.text for d in docs] == texts[:-1]  # the empty row is dropped
    assert len(read_corpus(f"hf:{tmp_path / 'ds'}", text_field="body", max_documents=2, progress=False)) == 2
    with pytest.raises(ValueError, match=r"text_field='text' is not a column .*\['body', 'n'\]"):
        read_corpus(f"hf:{tmp_path / 'ds'}", progress=False)
    with pytest.raises(ValueError, match="text_field='n' .* holds int values, not text"):
        read_corpus(f"hf:{tmp_path / 'ds'}", text_field="n", progress=False)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]})}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert [d.text for d in read_corpus(f"hf:{tmp_path / 'dd'}", progress=False)] == ["a b"]
    with pytest.raises(ValueError, match=r"hf_split='validation' is not in the saved dataset .*\['train'\]"):
        read_corpus(f"hf:{tmp_path / 'dd'}", hf_split="validation", progress=False)


def test_files_directories_globs_and_lists(tmp_path, corpus):
    (tmp_path / "a.md").write_text("alpha")
    (tmp_path / "b.bin").write_text("skipped by extension")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("gamma")
    (tmp_path / "sub" / "d.py").write_bytes(b"\xff\xfe not utf-8")
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        docs = read_corpus(str(tmp_path), progress=False)
    assert [(d.name, d.text) for d in docs] == [("a.md", "alpha"), ("sub/c.py", "gamma")]
    assert [d.text for d in read_corpus(str(tmp_path / "*.md"), progress=False)] == ["alpha"]
    both = read_corpus(
        [str(tmp_path / "a.md"), str(corpus[0] / "doc00*.txt")], max_documents=3, progress=False
    )
    assert [d.name.rsplit("/", 1)[-1] for d in both] == ["a.md", "doc000.txt", "doc001.txt"]


def test_stdlib_corpus(tmp_path):
    paths = stdlib_paths()
    assert paths == sorted(paths) and len(paths) > 100
    bad = {"test", "tests", "idlelib", "idle_test", "site-packages"}
    assert not any(bad & set(p.parts) or p.name.startswith("test_") for p in paths)
    module = RLMDataModule(
        max_documents=12, vocab_size=512, seq_len=64, segment_len=16, cache_dir=str(tmp_path), progress=False
    )
    module.setup()
    assert module.store.n_docs == 12 and module.store.names == sorted(module.store.names)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert module.text_of(0) == (root / module.store.names[0]).read_text(encoding="utf-8")
    assert next(iter(module.train_dataloader()))["tokens"].shape == (8, 64)


def test_configs_construct_a_datamodule(tmp_path):
    root = Path(__file__).resolve().parents[2] / "configs" / "data"
    for name in ("stdlib.yaml", "tiny.yaml"):
        args = yaml.safe_load((root / name).read_text())["data"]
        RLMDataModule(**{**args, "cache_dir": str(tmp_path)})  # every key is a constructor argument


# ---- errors --------------------------------------------------------------------------------------------
def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus path '.*nope' does not exist; accepted: 'stdlib'"):
        read_corpus(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"corpus glob '.*\*\.zzz' matched no files"):
        read_corpus(str(tmp_path / "*.zzz"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="has no non-empty documents"):
        read_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="corpus is an empty list"):
        read_corpus([])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 30}, "seq_len=30 is not a multiple of segment_len=8"),
        ({"vocab_size": 100}, "vocab_size=100; accepted: >= 261"),
        ({"val_fraction": 1.0}, "val_fraction=1.0; accepted: 0 <= val_fraction < 1"),
        ({"batch_size": 0}, "batch_size=0; accepted: a positive integer"),
    ],
)
def test_argument_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _dm(tmp_path, tmp_path, **kwargs)


def test_unknown_tokenizer_model_type_is_refused_before_training(tmp_path):
    """The command line refuses it by its Literal type; Python callers get this before any training."""
    with pytest.raises(ValueError, match=r"tokenizer_model_type='wordpiece'; accepted: \['bpe'"):
        Tokenizer.train(["text"], tmp_path / "t.model", vocab_size=300, model_type="wordpiece")


def test_vocab_too_large_names_the_largest_that_works(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=60000 is too large .* the largest that works is \d+"):
        _dm(corpus[0], tmp_path, vocab_size=60000).setup()


def test_seq_len_longer_than_every_document(corpus, dm, tmp_path):
    longest = int(dm.store.doc_lengths.max())
    with pytest.raises(ValueError, match=f"seq_len=4096 but the longest document has {longest} tokens"):
        _dm(corpus[0], dm.cache_dir, seq_len=4096).setup()


# slow: runs the benchmark script end to end at its smoke size
@pytest.mark.slow
def test_benchmark_script_smoke(corpus, tmp_path):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data.py"
    spec = importlib.util.spec_from_file_location("benchmark_data", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = [
        "--corpus",
        str(corpus[0]),
        "--vocab-size",
        "300",
        "--seq-len",
        str(SEQ),
        "--segment-len",
        str(SEG),
    ]
    out = bench.main([*args, "--batch-sizes", "4", "--batches", "3", "--cache-dir", str(tmp_path)])
    assert out.splitlines()[0].endswith("speed-up |") and len(out.splitlines()) == 3


def test_damaged_cache_is_refused(corpus, tmp_path):
    module = _dm(corpus[0], tmp_path)
    module.setup()
    np.save(module.cache_path() / "doc_offsets.npy", np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="token cache .* is inconsistent .*: delete it to rebuild"):
        _dm(corpus[0], tmp_path).setup()


def test_batches_for_a_gpu_are_pinned_and_others_not(dm, monkeypatch):
    """A trainer on a CUDA device gets page-locked batches (their copy to the GPU then does not block the host);
    pin_memory needs CUDA, so it is replaced here by a marker."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone().fill_(-7))
    for device, want in (("cpu", False), ("cuda", True)):
        strategy = SimpleNamespace(root_device=torch.device(device))
        trainer = SimpleNamespace(strategy=strategy, global_rank=0, world_size=1, current_epoch=0)
        monkeypatch.setattr(dm, "trainer", trainer)
        batch = next(iter(dm.train_dataloader()))
        assert (batch["tokens"] == -7).all().item() is want
        assert dm.val_dataloader().pin_memory is want
