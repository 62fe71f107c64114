"""How long SGLang's decode steps wait for the drafter while an external corpus loads at run time.

SGLang loads a corpus sent to ``/add_external_corpus`` on a background thread while its scheduler
keeps drafting. This loads a synthetic corpus (``--documents`` random documents of
``--doc-tokens`` tokens each) into ``RolloutSpecCorpus`` on a thread, while the main thread drafts
for one fresh request every ``--get-every-ms`` (as a decode step would), and prints the drafts'
waits. Two rows in one run: the corpus indexed in drafter calls of ``LOAD_BATCH_TOKENS`` tokens
(what the adapter does), and in one call (a batch size above the corpus's).

    python bench/corpus_load_wait.py
    python bench/corpus_load_wait.py --documents 1000 --rounds 1
"""
from __future__ import annotations

import threading
import time

import numpy as np

from rollout_spec.cli_args import DefaultsParser, int_arg
from rollout_spec.integrations.sglang.corpus import LOAD_BATCH_TOKENS, SEPARATOR_TOKEN, RolloutSpecCorpus

VOCAB = 32_000
# Most tokens of the synthetic corpus (each flag allows 10**6, together 10**12): ten times the
# corpus's default external_corpus_max_tokens, ~4 GB as the Python lists it is built and sent as.
MAX_CORPUS_TOKENS = 100_000_000


def corpus_chunks(documents: int, doc_tokens: int, seed: int = 0) -> list[list[int]]:
    """Random documents as SGLang streams them: a separator before each document after the first."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, VOCAB, doc_tokens).tolist() for _ in range(documents)]
    return [docs[0]] + [[SEPARATOR_TOKEN] + doc for doc in docs[1:]]


def waits_during_load(chunks: list[list[int]], batch_tokens: int,
                      get_every_s: float) -> tuple[float, list[float]]:
    """Load ``chunks`` on a thread with ``batch_tokens`` per drafter call; returns the load's
    seconds and the wall seconds of each draft the main thread asked for meanwhile (a fresh
    request's ``batch_get`` and ``erase_match_state``, both drafter calls)."""
    corpus = RolloutSpecCorpus(max_trie_depth=12, draft_token_num=8, forward_hook=False,
                               external_corpus_max_tokens=sum(map(len, chunks)))
    corpus.load_batch_tokens = batch_tokens
    rng = np.random.default_rng(1)
    loaded = threading.Event()
    load_seconds: list[float] = []

    def load() -> None:
        start = time.perf_counter()
        corpus.load_external_corpus_named("bench", chunks)
        load_seconds.append(time.perf_counter() - start)
        loaded.set()

    loader = threading.Thread(target=load)
    loader.start()
    waits = []
    while not loaded.is_set():
        rid, query = f"r{len(waits)}", rng.integers(0, VOCAB, 4).tolist()
        start = time.perf_counter()
        corpus.batch_get([rid], [query], [len(query)])
        corpus.erase_match_state([rid])
        waits.append(time.perf_counter() - start)
        time.sleep(get_every_s)
    loader.join()
    return load_seconds[0], waits


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run both ways ``--rounds`` times, print one table."""
    ap = DefaultsParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int_arg("--documents", 1, 1_000_000), default=4000)
    ap.add_argument("--doc-tokens", type=int_arg("--doc-tokens", 1, 1_000_000), default=500)
    ap.add_argument("--get-every-ms", type=int_arg("--get-every-ms", 0, 1000), default=2)
    ap.add_argument("--rounds", type=int_arg("--rounds", 1, 100), default=3)
    args = ap.parse_args(argv)
    if args.documents * args.doc_tokens > MAX_CORPUS_TOKENS:
        ap.error(f"--documents {args.documents} x --doc-tokens {args.doc_tokens} must be at most "
                 f"{MAX_CORPUS_TOKENS:,} corpus tokens, got {args.documents * args.doc_tokens:,}")
    chunks = corpus_chunks(args.documents, args.doc_tokens)
    tokens = sum(map(len, chunks))
    default_batch = LOAD_BATCH_TOKENS
    ways = {f"batches of {default_batch:,} tokens": default_batch, "one call": tokens + 1}
    print(f"corpus: {args.documents:,} documents, {tokens:,} tokens (separators included); "
          f"a draft every {args.get_every_ms} ms\n")
    print("| load | round | load ms | drafts during it | median wait ms | max wait ms |\n"
          "|---|---|---|---|---|---|")
    for r in range(args.rounds):
        for name, batch in ways.items():
            seconds, waits = waits_during_load(chunks, batch, args.get_every_ms / 1000)
            ms = np.array(waits) * 1000
            median, most = (f"{np.median(ms):.2f}", f"{ms.max():.1f}") if len(ms) else ("-", "-")
            print(f"| {name} | {r + 1} | {seconds * 1000:.1f} | {len(waits)} | {median} | {most} |", flush=True)


if __name__ == "__main__":
    main()
