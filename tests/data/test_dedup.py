"""rlm.data.dedup: MinHash + LSH near-duplicate groups against an all-pairs exact reference; the store's split."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import asdict

import numpy as np
import pytest

from rlm.data.corpus import Document
from rlm.data.dedup import near_duplicate_groups, removed_documents
from rlm.data.module import RLMDataModule
from rlm.data.store import CacheKey, TokenStore, build_store


def _shingle_set(text: str) -> set:
    words = text.split()
    if len(words) < 5:
        return {(w,) for w in words}
    return {tuple(words[i : i + 5]) for i in range(len(words) - 4)}


def _reference_groups(texts: list[str], threshold: float) -> list[list[int]]:
    """All pairs, exact Jaccard of the 5-gram (word) sets, joined transitively."""
    sets = [_shingle_set(t) for t in texts]
    group = list(range(len(texts)))
    for i, j in itertools.combinations(range(len(texts)), 2):
        a, b = sets[i], sets[j]
        jac = len(a & b) / len(a | b) if a | b else 1.0
        if texts[i] == texts[j] or jac >= threshold:
            old, new = max(group[i], group[j]), min(group[i], group[j])
            group = [new if g == old else g for g in group]
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        out.setdefault(g, []).append(i)
    return [g for g in out.values() if len(g) > 1]


def _words(rng: random.Random, n: int) -> list[str]:
    return [f"w{rng.randrange(5000)}" for _ in range(n)]


def _change(words: list[str], at: list[int], rng: random.Random) -> str:
    words = list(words)
    for i in at:
        words[i] = f"x{rng.randrange(10**9)}"
    return " ".join(words)


def _corpus(seed: int = 0) -> list[str]:
    """Unrelated documents, plus near copies (a word changed), exact copies, a chain, short documents."""
    rng = random.Random(seed)
    base = [_words(rng, rng.randrange(60, 200)) for _ in range(40)]
    texts = [" ".join(w) for w in base]
    texts.append(_change(base[0], [30], rng))  # J ~ 0.95 with 0
    texts.append(texts[1])  # exact copy of 1
    texts.append("\n".join(base[2]))  # same words, other whitespace: identical shingles
    texts.append(_change(base[3], [10, 40], rng))  # J ~ 0.8..0.9 with 3
    texts.append(_change(base[4], list(range(20, 27)), rng))  # 7 adjacent words: 11 of 96+ shingles
    texts.append("tiny doc here")
    texts.append("here doc tiny")  # same word set as the previous, fewer than 5 words
    texts.append("tiny doc there")
    texts.append(texts[5] + " " + " ".join(_words(rng, 3)))  # 5 plus a short tail
    return texts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_equal_the_all_pairs_reference(seed):
    texts = _corpus(seed)
    for threshold in (0.8, 0.5, 0.95):
        assert near_duplicate_groups(texts, threshold, seed=seed) == _reference_groups(texts, threshold)
    groups = near_duplicate_groups(texts, 0.8)
    for pair in ([0, 40], [1, 41], [2, 42], [45, 46]):
        assert any(set(pair) <= set(g) for g in groups), pair
    assert removed_documents(texts, 0.8).tolist() == sorted(i for g in groups for i in g[1:])


def test_a_pair_just_below_the_threshold_is_kept():
    rng = random.Random(3)
    words = [f"u{i}" for i in range(101)]  # 97 distinct shingles
    # 7 adjacent words changed: 11 shingles differ, J = 86 / 108 = 0.796; 6 changed: J = 87 / 107 = 0.813
    below, above = _change(words, list(range(50, 57)), rng), _change(words, list(range(50, 56)), rng)
    text = " ".join(words)
    assert near_duplicate_groups([text, below], 0.8) == []
    assert near_duplicate_groups([text, above], 0.8) == [[0, 1]]
    assert near_duplicate_groups([text, below], 0.79) == [[0, 1]]


def test_bad_threshold_is_refused():
    with pytest.raises(ValueError, match=r"threshold=1.5; accepted: 0 < threshold <= 1"):
        near_duplicate_groups(["a b c"], 1.5)


def _key(threshold):
    return CacheKey(corpus="x", vocab_size=300, model_type="bpe", seed=0, val_fraction=0.2,
                    max_tokenizer_chars=10**6, test_fraction=0.2, dedup_threshold=threshold)  # fmt: skip


def _code_docs() -> list[Document]:
    rng = random.Random(5)
    texts = []
    for i in range(30):
        lines = [f"def f{i}_{k}(x):\n    return x * {rng.randrange(100)} + {k}\n" for k in range(20)]
        texts.append("".join(lines))
        if i % 3 == 0:  # a near copy (one constant changed) and an exact copy
            texts.append(texts[-1].replace("return x", "return -x", 1))
            texts.append(texts[-2])
    return [Document(f"d{i}.py", t) for i, t in enumerate(texts)]


def test_build_store_keeps_near_duplicates_out_of_other_splits(tmp_path):
    docs = _code_docs()
    build_store(tmp_path / "entry", docs, _key(0.8), progress=False)
    store = TokenStore(tmp_path / "entry")
    removed = np.load(tmp_path / "entry" / "removed_docs.npy")
    assert removed.dtype == np.int64 and removed.tolist() == sorted(removed.tolist())
    expected = removed_documents([d.text for d in docs], 0.8)
    assert len(removed) >= 20 and removed.tolist() == expected.tolist() == store.removed_docs.tolist()
    splits = [set(store.train_docs.tolist()), set(store.val_docs.tolist()), set(store.test_docs.tolist())]
    assert all(s and not s & set(removed.tolist()) for s in splits)
    assert sum(map(len, splits)) + len(removed) == store.n_docs == len(docs)
    for group in near_duplicate_groups([d.text for d in docs], 0.8):  # one member left, in one split
        assert sum(len(set(group) & s) for s in splits) == 1
    meta = json.loads((tmp_path / "entry" / "meta.json").read_text())
    assert meta["near_duplicates_removed"] == len(removed) and meta["dedup_threshold"] == 0.8


def test_an_entry_without_removed_docs_loads(tmp_path):
    """Entries written before deduplication have no removed_docs.npy: nothing removed."""
    docs = _code_docs()
    build_store(tmp_path / "entry", docs, _key(None), progress=False)
    assert not (tmp_path / "entry" / "removed_docs.npy").exists()
    store = TokenStore(tmp_path / "entry")
    assert len(store.removed_docs) == 0
    assert len(store.train_docs) + len(store.val_docs) + len(store.test_docs) == len(docs)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, float("nan")])
def test_bad_dedup_threshold_names_the_value_and_what_is_accepted(tmp_path, bad):
    with pytest.raises(
        ValueError, match=rf"dedup_threshold={bad}; accepted: None \(no removal\) or 0 < t <= 1"
    ):
        RLMDataModule(corpus=str(tmp_path), cache_dir=str(tmp_path), vocab_size=300, dedup_threshold=bad)


def test_the_default_asks_for_a_new_entry_and_none_keeps_the_old_name():
    """A cache built before deduplication (no dedup_threshold in its key) is not reused at the default 0.8,
    and dedup_threshold=None names exactly that old entry."""
    old = _key(None)
    payload = {
        k: v for k, v in asdict(old).items() if k not in ("dedup_threshold", "tokenizer")
    }  # at defaults
    digest = hashlib.sha256(json.dumps({"format": 1, **payload}, sort_keys=True).encode()).hexdigest()[:20]
    assert old.digest() == digest
    assert _key(0.8).digest() != digest and _key(0.8).digest() != _key(0.9).digest()


def test_the_data_module_removes_near_duplicates_by_default(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in _code_docs():
        (corpus / d.name).write_text(d.text)
    args = dict(corpus=str(corpus), cache_dir=str(tmp_path / "cache"), vocab_size=300, seq_len=32,
                segment_len=8, val_fraction=0.2, test_fraction=0.2, progress=False)  # fmt: skip
    plain, dedup = RLMDataModule(**args, dedup_threshold=None), RLMDataModule(**args)
    assert dedup.dedup_threshold == 0.8 and plain.cache_path() != dedup.cache_path()
    plain.setup(), dedup.setup()
    assert len(plain.store.removed_docs) == 0 and len(dedup.store.removed_docs) >= 20
    splits = [dedup.store.train_docs, dedup.store.val_docs, dedup.store.test_docs]
    assert not set(np.concatenate(splits).tolist()) & set(dedup.store.removed_docs.tolist())


def test_a_checkpoint_from_before_deduplication_names_its_undeduplicated_entry():
    from rlm.data.carried import data_settings

    old = {"datamodule_hyper_parameters": {"corpus": "stdlib", "val_fraction": 0.05, "seed": 0}}
    assert data_settings(old, "old.ckpt")["dedup_threshold"] is None
    new = {"datamodule_hyper_parameters": {"corpus": "stdlib", "dedup_threshold": 0.8}}
    assert data_settings(new, "new.ckpt")["dedup_threshold"] == 0.8


def test_a_stream_is_not_deduplicated_and_keeps_its_key(tmp_path):
    args = dict(corpus="hf:some/dataset", cache_dir=str(tmp_path), vocab_size=300, streaming=True)
    assert RLMDataModule(**args).cache_key() == RLMDataModule(**args, dedup_threshold=None).cache_key()
    assert RLMDataModule(**args).cache_key().dedup_threshold is None
