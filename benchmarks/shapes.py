"""The shapes of the performance suites, written once: the benchmarks and `make tune`
(benchmarks/tune.py) read them from here."""

from __future__ import annotations

from common import Shape

# The forward suite (bench_forward.py), each a class of inputs: reranks of short and long
# docs, ColPali pages, a small head dim, in-batch training batches, few long docs, a corpus.
FORWARD = [
    Shape("colbert-rerank", 1, 1000, 32, 300, 128),
    Shape("text-long", 1, 1000, 32, 1024, 128),
    Shape("colpali-rerank", 1, 1000, 128, 1024, 128),
    Shape("colpali-compute", 1, 500, 1024, 1024, 128),
    Shape("lateon-edge", 1, 1000, 32, 1024, 48),
    Shape("inbatch-256", 256, 256, 32, 300, 128),
    Shape("longdoc", 16, 32, 32, 8192, 128),
    Shape("corpus-100k", 16, 100000, 32, 128, 128),
]
# Forward keys `make tune` also sweeps, which no forward suite row has: the training
# suite's ColPali batch, and a batched rerank (8 queries' candidates in one call), which on
# the default config (4 queries stacked) ran 14% slower than on its tuned one (H200, 0.112
# against 0.096 ms, commit 64e95e3; through lik.maxsim 0.115 -> 0.098 ms on an H100 and
# 0.113 -> 0.096 on an H200: commit a25e1d4).
TUNED_ONLY = [
    Shape("train-colpali-32", 32, 32, 128, 1024, 128),
    Shape("rerank-8q", 8, 2000, 32, 300, 128),
]
# (name, Nq, Nd or docs per query (kd), Lq, Ld, d, layout): the training suite
# (bench_train.py); `make tune` keys and tunes their forward (argmax saved) and backward.
TRAIN = [
    ("inbatch-256", 256, 256, 32, 300, 128, "dense"),
    ("colpali-32", 32, 32, 128, 1024, 128, "dense"),
    ("kd-64x32", 64, 32, 32, 300, 128, "kd"),
]
