"""Text corpora and token-budget batching: the offset index, bad inputs, the changed-corpus
policy, exact O(window) resume, worker and rank independence, and the seq2seq golden test.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import unbroken
from tests._logs import logged, logs_match
from tests.golden import ROOT, assert_identical, launch, run_interrupted
from unbroken import DataError
from unbroken.data import CharVocab, EpochOrder, TextCorpus, TokenBatchLoader, WordVocab
from unbroken.data._index import LineIndex

SEQ2SEQ = ROOT / "examples" / "seq2seq.py"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write(path: Path, lines: list[str], end: str = "\n") -> str:
    path.write_bytes("".join(line + end for line in lines).encode())
    return str(path)


def sentences(n: int, seed: int = 0, longest: int = 12) -> list[str]:
    """n lines of 1..longest words, a different length mix per seed."""
    rng = np.random.default_rng(seed)
    return [
        " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), rng.integers(1, longest + 1)))
        for _ in range(n)
    ]


def pair(tmp_path: Path, n: int, **kwargs: Any) -> TextCorpus:
    """A parallel corpus of n lines, word-tokenized (a token = a word)."""
    src = write(tmp_path / "c.src", sentences(n, 1))
    tgt = write(tmp_path / "c.tgt", sentences(n, 2))
    return TextCorpus([src, tgt], tokenize=str.split, **kwargs)


class Counting(TextCorpus):
    """Counts the items fetched in this process."""

    calls = 0

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        Counting.calls += 1
        return super().__getitem__(i)


def drain(loader: TokenBatchLoader, epochs: int = 1) -> list[tuple[int, list[int]]]:
    out = []
    for _ in range(epochs):
        for _batch in loader:
            out.append((loader.epoch, loader.last_indices))
    return out


# ---- the corpus and its index ------------------------------------------------------------------


def test_items_are_aligned_lines_crlf_and_a_last_line_without_newline(tmp_path):
    a = tmp_path / "a.txt"
    a.write_bytes(b"one two\r\nsi\xc3\xa9te\nlast")
    b = write(tmp_path / "b.txt", ["1", "2", "3"])
    corpus = TextCorpus([a, b])
    assert len(corpus) == 3
    assert [corpus[i] for i in range(3)] == [("one two", "1"), ("siéte", "2"), ("last", "3")]
    tok = TextCorpus([a, b], tokenize=[str.split, None])
    assert tok[0] == (["one", "two"], "1") and tok[-1] == (["last"], "3")
    with pytest.raises(IndexError):
        corpus[3]


def test_index_is_built_once_reused_and_rebuilt_when_the_file_changes(tmp_path):
    path = write(tmp_path / "a.txt", sentences(50))
    first = TextCorpus(path)
    assert first.rebuilt == [path]
    assert os.path.exists(path + ".unbroken-index.npy")
    assert os.path.exists(path + ".unbroken-index.json")
    with logged() as said:
        again = TextCorpus(path)
    assert said == []  # a valid index is reused silently
    assert again.rebuilt == [] and again.fingerprint == first.fingerprint
    assert isinstance(again.files[0].offsets, np.memmap)  # loaded, not rebuilt
    # Same size, new content: the head checksum differs.
    text = Path(path).read_text()
    Path(path).write_text(text.replace("alpha", "ALPHA", 1))
    with logs_match("changed since its index was built"):
        changed = TextCorpus(path)
    assert changed.rebuilt == [path] and changed.fingerprint != first.fingerprint
    assert changed[0] == tuple(Path(path).read_text().splitlines()[:1])
    # Touched only: the index is rebuilt, but the content (and the fingerprint) is the same.
    os.utime(path, ns=(1, 1))
    with logs_match("mtime_ns"):
        touched = TextCorpus(path)
    assert touched.fingerprint == changed.fingerprint
    # A damaged index is rebuilt, not trusted.
    with open(path + ".unbroken-index.npy", "r+b") as f:
        f.truncate(100)
    with logs_match("is unreadable; rebuilding"):
        repaired = TextCorpus(path)
    assert repaired.rebuilt == [path] and repaired[-1] == touched[-1]


def test_a_line_is_read_in_one_slice_of_exactly_its_bytes(tmp_path, monkeypatch):
    lines = sentences(2000)
    path = write(tmp_path / "a.txt", lines)
    corpus = TextCorpus(path)
    reads: list[tuple[int, int]] = []
    real = LineIndex.read

    def spy(self, start, stop):
        reads.append((start, stop))
        return real(self, start, stop)

    monkeypatch.setattr(LineIndex, "read", spy)
    for i in (0, 1000, 1999):
        reads.clear()
        assert corpus[i] == (lines[i],)
        start = sum(len(line) + 1 for line in lines[:i])
        assert reads == [(start, start + len(lines[i]) + 1)]


def test_index_goes_to_cache_dir_or_memory_when_it_cannot_be_written(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    path = write(data / "a.txt", sentences(20))
    cache = tmp_path / "cache"
    corpus = TextCorpus(path, cache_dir=cache)
    assert sorted(os.listdir(data)) == ["a.txt"]
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 1
    assert TextCorpus(path, cache_dir=cache).rebuilt == []
    # The index's place is taken by a directory: it cannot be written; kept in memory instead.
    os.mkdir(path + ".unbroken-index.npy")
    with logs_match("keeping it in memory"):
        mem = TextCorpus(path)
    assert mem[5] == corpus[5] and mem.files[0].in_memory


def test_chunked_order_is_a_permutation_of_shuffled_chunks(tmp_path):
    n, c = 1050, 100
    order = EpochOrder(3, 1, n, chunk_lines=c)
    full = np.asarray(order)
    assert sorted(full.tolist()) == list(range(n))
    chunk_of = full // c
    assert int((chunk_of[1:] != chunk_of[:-1]).sum()) == 10  # 11 chunks, each one contiguous run
    assert full.tolist() != sorted(full.tolist())
    assert not np.array_equal(full, np.asarray(EpochOrder(3, 2, n, chunk_lines=c)))
    # A slice permutes only the chunks it touches and equals the full order's slice.
    fresh = EpochOrder(3, 1, n, chunk_lines=c)
    assert np.array_equal(fresh.slice(640, 660), full[640:660])
    assert len(fresh._inner) <= 2
    # Unchunked, the order is the one unbroken.MapLoader uses.
    assert np.array_equal(np.asarray(EpochOrder(3, 1, n)), unbroken.data.epoch_order(3, 1, n, True))
    corpus = pair(tmp_path, 300, chunk_lines=64)
    assert corpus.order(5, 0).chunk_lines == 64


# ---- bad inputs ----------------------------------------------------------------------------------


def test_bad_inputs_name_the_file_and_line(tmp_path):
    good = write(tmp_path / "good.en", ["a", "b", "c"])
    short = write(tmp_path / "short.es", ["x", "y"])
    with pytest.raises(DataError, match=r"short\.es has 2.*line 3 of .*good\.en"):
        TextCorpus([good, short])
    with pytest.raises(DataError, match=r"missing\.es does not exist"):
        TextCorpus([good, str(tmp_path / "missing.es")])
    bad = tmp_path / "bad.es"
    bad.write_bytes(b"uno\ndos\ntr\xffes\n")
    with pytest.raises(DataError, match=r"bad\.es: line 3 is not valid UTF-8.*0xff at byte 3"):
        TextCorpus([good, bad])
    holes = write(tmp_path / "holes.es", ["x", "", "z"])
    with pytest.raises(DataError, match=r"holes\.es: line 2 is empty.*skip_empty=True"):
        TextCorpus([good, holes])


def test_skip_empty_drops_the_line_from_every_file(tmp_path):
    en = write(tmp_path / "a.en", ["one", "two", "", "four", "five"])
    es = write(tmp_path / "a.es", ["uno", "", "tres", "cuatro", "\r"])
    corpus = TextCorpus([en, es], skip_empty=True)
    assert [corpus[i] for i in range(len(corpus))] == [("one", "uno"), ("four", "cuatro")]
    assert [corpus.line_number(i) for i in range(len(corpus))] == [0, 3]
    assert corpus.where(1) == f"line 4 of {en}, {es}"


def test_a_sample_longer_than_the_budget_is_an_error_or_skipped(tmp_path):
    lines = ["a b", "a b c", "a " * 30, "c d"]
    src = write(tmp_path / "long.en", lines)
    tgt = write(tmp_path / "long.es", ["x"] * 4)
    corpus = TextCorpus([src, tgt], tokenize=str.split)
    with pytest.raises(DataError, match=r"line 3 of .*long\.en.* is 30 tokens long.*max_tokens=8"):
        drain(TokenBatchLoader(corpus, 8, window=4))
    skip = TokenBatchLoader(corpus, 8, window=4, too_long="skip")
    got = sorted(i for _, b in drain(skip) for i in b)
    assert got == [0, 1, 3] and skip.skipped == 1


# ---- token-budget batching and its exact resume --------------------------------------------------


def test_batches_fit_the_budget_and_cover_every_sample_once_per_epoch(tmp_path):
    corpus = pair(tmp_path, 400)
    loader = TokenBatchLoader(corpus, 60, window=50, seed=4)
    stream = drain(loader, epochs=2)
    for epoch in (0, 1):
        batches = [b for e, b in stream if e == epoch]
        assert sorted(i for b in batches for i in b) == list(range(400))
        for b in batches:
            assert len(b) * max(max(len(f) for f in corpus[i]) for i in b) <= 60
    assert [b for e, b in stream if e == 0] != [b for e, b in stream if e == 1]
    again = TokenBatchLoader(corpus, 60, window=50, seed=4)
    assert drain(again, epochs=2) == stream
    assert drain(TokenBatchLoader(corpus, 60, window=50, seed=5)) != stream[: len(stream) // 2]


def test_resume_from_every_position_continues_the_same_stream(tmp_path):
    corpus = pair(tmp_path, 120)
    ref = TokenBatchLoader(corpus, 40, window=16, seed=1)
    full, states = [], []
    for _ in range(2):
        for _batch in ref:
            full.append((ref.epoch, ref.last_indices))
            states.append(ref.state_dict())
    assert any(s["batch"] > 0 for s in states) and any(s["batch"] == 0 for s in states)
    for k in range(0, len(full), 3):
        resumed = TokenBatchLoader(corpus, 40, window=16, seed=1)
        resumed.load_state_dict(states[k])
        rest = drain(resumed, epochs=2 - states[k]["epoch"])
        # An epoch that had not been seen to end yields its (empty) end first, then the next.
        assert [x for x in rest] == full[k + 1 :], f"resumed after batch {k}"


def test_a_budget_change_applies_from_the_next_window(tmp_path):
    corpus = pair(tmp_path, 96)
    ref = TokenBatchLoader(corpus, 40, window=16, seed=2)
    it = iter(ref)
    while True:
        next(it)
        if ref.state_dict()["batch"] > 0:
            break
    state = ref.state_dict()
    resumed = TokenBatchLoader(corpus, 80, window=16, seed=2)
    resumed.load_state_dict(state)
    got = drain(resumed)
    same = TokenBatchLoader(corpus, 40, window=16, seed=2)
    same.load_state_dict(state)
    expected = []
    for _ in same:  # the rest of the window in progress is cut with the old budget
        expected.append(same.last_indices)
        if same.state_dict()["batch"] == 0:
            break
    assert [b for _, b in got[: len(expected)]] == expected
    assert max(len(b) for _, b in got[len(expected) :]) > max(len(b) for b in expected)


def test_resume_work_does_not_grow_with_the_position(tmp_path):
    src = write(tmp_path / "big.src", sentences(4000, 1, longest=4))
    corpus = Counting(src, tokenize=str.split)
    ref = TokenBatchLoader(corpus, 16, window=8, seed=0)
    batches, states = [], []
    for _batch in ref:
        batches.append(ref.last_indices)
        states.append(ref.state_dict())
    at = {
        w: next(k for k, s in enumerate(states) if s["window"] == w and s["batch"])
        for w in (2, 480)
    }
    work = {}
    for w, k in at.items():
        loader = TokenBatchLoader(corpus, 16, window=8, seed=0)
        loader.load_state_dict(states[k])
        Counting.calls = 0
        next(iter(loader))
        assert loader.last_indices == batches[k + 1], "the resumed batch is the one that came next"
        work[w] = (Counting.calls, loader.windows_computed)
    assert work[2] == work[480] == (8, 1), work


# ---- workers, ranks, changed corpora -------------------------------------------------------------


def noisy_split(text: str) -> list[str]:
    """Word dropout from the global stream: unbroken seeds it per (seed, epoch, line)."""
    return [w for w in text.split() if random.random() < 0.7] or ["<empty>"]


def test_iterating_leaves_the_global_random_streams_alone(tmp_path):
    corpus = pair(tmp_path, 100)
    corpus.tokenize = [noisy_split, noisy_split]
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    drain(TokenBatchLoader(corpus, 40, window=16), epochs=2)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def _joined(items):
    return [tuple(f if isinstance(f, str) else " ".join(f) for f in item) for item in items]


def test_batches_do_not_depend_on_the_number_of_workers(tmp_path):
    corpus = pair(tmp_path, 200)
    corpus.tokenize = [noisy_split, str.split]  # random per sample, yet the same anywhere
    runs = []
    for workers in (0, 2):
        loader = TokenBatchLoader(
            corpus, 50, window=32, seed=3, num_workers=workers, collate_fn=_joined
        )
        it = iter(loader)
        head = [(next(it), loader.last_indices) for _ in range(5)]
        state = loader.state_dict()  # mid-epoch, with batches prefetched by the workers
        loader.close()
        resumed = TokenBatchLoader(
            corpus, 50, window=32, seed=3, num_workers=workers, collate_fn=_joined
        )
        resumed.load_state_dict(state)
        tail = [(batch, resumed.last_indices) for batch in resumed]
        resumed.close()
        runs.append((head + tail, state))
    assert runs[0] == runs[1]
    stream = runs[0][0]
    assert sorted(i for _, idx in stream for i in idx) == list(range(200))
    pairs = [(item, i) for batch, idx in stream for item, i in zip(batch, idx, strict=True)]
    assert all(item[1] == corpus.text(i)[1] for item, i in pairs)
    dropped = [len(item[0].split()) < len(corpus.text(i)[0].split()) for item, i in pairs]
    assert any(dropped) and not all(dropped)


def test_rank_slices_make_up_the_global_batch_for_any_world_size(tmp_path):
    corpus = pair(tmp_path, 150)
    glob = drain(TokenBatchLoader(corpus, 48, window=30, seed=6))
    for world in (2, 3):
        ranks = [
            TokenBatchLoader(corpus, 48, window=30, seed=6, rank=r, world_size=world)
            for r in range(world)
        ]
        per_rank = [[(x.epoch, x.last_indices, local) for local in x] for x in ranks]
        kept = [g for g in glob if len(g[1]) >= world]  # fewer samples than ranks: skipped
        assert len(kept) > len(glob) // 2
        assert all(len(p) == len(kept) for p in per_rank)  # every rank takes the same steps
        for step, (epoch, indices) in enumerate(kept):
            union = []
            for r in range(world):
                e, last, local = per_rank[r][step]
                assert (e, last) == (epoch, indices) and local, f"rank {r} step {step}"
                union += local
            assert union == [corpus[i] for i in indices]  # contiguous slices, in rank order
    # Elastic: a position saved on 1 rank continues on 2 with the same global batches.
    one = TokenBatchLoader(corpus, 48, window=30, seed=6)
    it = iter(one)
    for _ in range(4):
        next(it)
    state = one.state_dict()
    two = TokenBatchLoader(corpus, 48, window=30, seed=6, rank=1, world_size=2)
    two.load_state_dict(state)
    assert [b for _, b in drain(two)] == [b for _, b in glob[4:] if len(b) >= 2]


def test_a_changed_corpus_refuses_the_saved_position_or_restarts_the_epoch(tmp_path):
    src = tmp_path / "c.src"
    write(src, sentences(80, 1))
    corpus = TextCorpus(src, tokenize=str.split)
    loader = TokenBatchLoader(corpus, 30, window=16, seed=0)
    drain(loader)
    it = iter(loader)  # epoch 1, a few batches in
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["fingerprint"] == corpus.fingerprint
    write(src, sentences(80, 9))  # edited in place
    with logs_match("rebuilding the index"):
        edited = TextCorpus(src, tokenize=str.split)
    with pytest.raises(DataError, match="corpus changed.*restart_epoch_on_change=True"):
        TokenBatchLoader(edited, 30, window=16, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="changed since the checkpoint"):
        edited.load_state_dict(corpus.state_dict())  # the corpus as a Run component
    restart = TokenBatchLoader(edited, 30, window=16, seed=0, restart_epoch_on_change=True)
    with logs_match("restarting epoch 1 from its start"):
        restart.load_state_dict(state)
    fresh = TokenBatchLoader(edited, 30, window=16, seed=0)
    fresh.set_epoch(1)
    assert drain(restart) == drain(fresh) and restart.epoch == 1
    # Other settings are refused whatever the policy.
    with pytest.raises(DataError, match="seed was 0"):
        TokenBatchLoader(edited, 30, seed=1, restart_epoch_on_change=True).load_state_dict(state)


def test_a_run_refuses_to_resume_on_a_changed_corpus(tmp_path):
    src = tmp_path / "c.src"
    write(src, sentences(40, 1))

    def launch_run(corpus):
        model = torch.nn.Linear(1, 1)
        loader = TokenBatchLoader(corpus, 30, window=8, seed=0)
        run = unbroken.Run(
            tmp_path / "run", model=model, loader=loader, max_steps=3, progress=False
        )
        for _ in run.loop(loader):
            run.step(loss=0.0)
        return loader

    launch_run(TextCorpus(src, tokenize=str.split))
    write(src, sentences(40, 2))
    with logs_match("rebuilding"), pytest.raises(DataError, match="changed"):
        launch_run(TextCorpus(src, tokenize=str.split))


# ---- vocabularies --------------------------------------------------------------------------------


def test_vocabularies_encode_decode_and_round_trip_through_json(tmp_path):
    corpus = TextCorpus(write(tmp_path / "v.txt", ["hola mundo", "adiós mundo", "hola"]))
    chars = CharVocab.from_corpus(corpus)
    assert chars.tokens[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert chars.decode(chars.encode("hola adiós", bos=True, eos=True)) == "hola adiós"
    assert chars.encode("x") == [chars.unk_id]
    words = WordVocab.from_corpus(corpus)
    assert words.tokens[4:] == ["hola", "mundo", "adiós"]  # by count, then code point
    assert words.decode(words.encode("mundo  hola\tnuevo")) == "mundo hola <unk>"
    path = tmp_path / "words.json"
    words.save(path)
    assert WordVocab.load(path) == words and CharVocab.from_json(chars.to_json()) == chars
    with pytest.raises(unbroken.ConfigError, match="holds a 'WordVocab'"):
        CharVocab.load(path)
    assert len(WordVocab.build(["a a b c"], max_size=5)) == 5


# ---- the seq2seq example: interrupted equals uninterrupted, bit for bit --------------------------

ARGS = [
    "--steps",
    "16",
    "--save-every",
    "4",
    "--lines",
    "24",
    "--max-tokens",
    "600",
    "--window",
    "8",
]


def _example():
    spec = importlib.util.spec_from_file_location("seq2seq_example", SEQ2SEQ)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def schedule(tmp_path_factory):
    """The loader's position after each step of the example's run (steps 1..16)."""
    mod = _example()
    a = mod.parse_args([*ARGS, "--run-dir", str(tmp_path_factory.mktemp("sched"))])
    _, _, _, loader = mod.load_data(a)
    states = [None]
    while len(states) <= 16:
        for _batch in loader:
            states.append(loader.state_dict())
            if len(states) > 16:
                break
    return states


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("seq2seq-ref")
    assert launch(SEQ2SEQ, [*ARGS, "--run-dir", str(d)]) == 0
    return d


def _points(states):
    """A step after which the position is inside a window, the epoch-0 boundary, and a
    step whose last checkpoint (save_every 4) was taken inside a window."""
    boundary = next(k for k in range(1, 16) if states[k]["start"] >= 24)
    mid = next(k for k in range(2, boundary) if states[k]["batch"] > 0)
    kill = next(k for k in range(boundary + 1, 16) if k % 4 and states[k // 4 * 4]["batch"] > 0)
    return mid, boundary, kill


CASES = {
    # SIGTERM saves at that very step: inside a window, then exactly at the end of epoch 0.
    "TERM-mid-window-then-epoch-boundary": ([], lambda m, b, k: [(m, "TERM"), (b, "TERM")]),
    # SIGKILL loses the steps since the last checkpoint, which was taken inside a window; the
    # relaunches use 2 workers against the 0-worker reference (batches do not depend on them).
    "KILL-after-mid-window-save-2-workers": (["--workers", "2"], lambda m, b, k: [(k, "KILL")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_seq2seq_interrupted_equals_uninterrupted(tmp_path, reference, schedule, case):
    mid, boundary, kill = _points(schedule)
    extra, interrupts = CASES[case]
    run_interrupted(SEQ2SEQ, [*ARGS, *extra], tmp_path, interrupts(mid, boundary, kill))
    assert_identical(reference, tmp_path)
    trace = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert trace == (reference / "trace.jsonl").read_text().splitlines() and len(trace) == 16
    ref_weights = (reference / "final.safetensors").read_bytes()
    assert (tmp_path / "final.safetensors").read_bytes() == ref_weights


def test_seq2seq_on_two_ranks_interrupted_equals_uninterrupted(tmp_path: Path) -> None:
    """The example under torch.distributed (DDP, gloo, 2 ranks each taking its slice of every
    token-budget batch): stopped by SIGTERM at the end of epoch 0 (where the rest of the epoch is
    too small to split, so the resumed pass yields nothing), resumed, equal to an uninterrupted
    2-rank run bit for bit; the trace holds the global batches."""
    from tests.dist_launch import launch as launch_ranks

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    args = [*ARGS, "--steps", "10"]
    assert launch_ranks(SEQ2SEQ, [*args, "--run-dir", str(ref)], 2)[0] == [0, 0]
    stop = [*args, "--run-dir", str(cut), "--signal-at", "5", "--signal", "TERM"]
    assert launch_ranks(SEQ2SEQ, stop, 2)[0] == [75, 75]
    assert launch_ranks(SEQ2SEQ, [*args, "--run-dir", str(cut)], 2)[0] == [0, 0]
    assert_identical(ref, cut)
    assert (cut / "trace.jsonl").read_text() == (ref / "trace.jsonl").read_text()
    one = tmp_path / "one"
    assert launch(SEQ2SEQ, [*args, "--run-dir", str(one)]) == 0
    # The same global batches as on one rank, except where the documented rule drops a batch
    # too small to give each rank a sample: epoch 0's last window leaves one sample over.
    two = [r["samples"] for r in unbroken.read_metrics(str(ref))]
    single = [r["samples"] for r in unbroken.read_metrics(str(one))]
    assert two[:6] == single[:6] and len(single[6]) == 1 and two[6] != single[6]
