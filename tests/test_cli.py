"""The `lik retrieve` command line: results, table, progress, and errors (exit status 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lik.cli import main
from lik.runtime.retrieval import retrieve

BIN = Path(sys.executable).parent
# The command runs where retrieve runs in these tests, so results compare bit for bit.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_DEVICE = ["--device", DEVICE]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """q.pt (a bare tensor) and d.pt (a dict with a mask) in a fresh working directory."""
    generator = torch.Generator().manual_seed(0)
    Q = torch.randn(3, 4, 8, generator=generator)
    D = torch.randn(9, 5, 8, generator=generator)
    d_mask = torch.rand(9, 5, generator=generator) < 0.8
    torch.save(Q, tmp_path / "q.pt")
    torch.save({"embeddings": D, "mask": d_mask}, tmp_path / "d.pt")
    monkeypatch.chdir(tmp_path)
    return Q, D, d_mask


def _retrieve_args(*extra: str) -> list[str]:
    return ["retrieve", "--queries", "q.pt", "--corpus", "d.pt", "--top-k", "3", *extra, *ON_DEVICE]


def _retrieve_here(Q, D, top_k, d_mask, **kwargs):
    """retrieve on DEVICE, results on the CPU like the saved ones."""
    scores, indices = retrieve(
        Q.to(DEVICE), D.to(DEVICE), top_k, d_mask=d_mask.to(DEVICE), **kwargs
    )
    return scores.cpu(), indices.cpu()


def test_writes_the_results_of_retrieve(files, capsys):
    Q, D, d_mask = files
    assert main(_retrieve_args("--chunk", "4", "--out", "out/results.pt")) == 0
    saved = torch.load("out/results.pt")
    scores, indices = _retrieve_here(Q, D, 3, d_mask)
    assert torch.equal(saved["indices"], indices) and torch.equal(saved["scores"], scores)
    assert saved["top_k"] == 3 and saved["normalize"] is True
    assert "wrote out/results.pt" in capsys.readouterr().out


def test_prints_a_top_k_table(files, capsys):
    Q, D, d_mask = files
    main(_retrieve_args("--show", "2"))
    out = capsys.readouterr().out
    scores, indices = _retrieve_here(Q, D, 3, d_mask)
    assert f"top-3 of 9 documents for 3 queries (normalize=True, {DEVICE})" in out
    header, first = out.splitlines()[1:3]
    assert header.split() == ["query", "rank", "doc", "score"]
    assert first.split() == ["0", "1", str(int(indices[0, 0])), f"{float(scores[0, 0]):.4f}"]
    assert "... 1 more queries not shown" in out


def test_no_normalize_and_a_single_query(files, tmp_path):
    Q, D, d_mask = files
    torch.save({"embeddings": Q[1]}, tmp_path / "one.pt")
    args = ["retrieve", "--queries", "one.pt", "--corpus", "d.pt", "--top-k", "20"]
    assert main([*args, "--no-normalize", "--out", "r.pt", *ON_DEVICE]) == 0
    saved = torch.load("r.pt")
    scores, indices = _retrieve_here(Q[1:2], D, 20, d_mask, normalize=False)
    assert saved["indices"].shape == (1, 9)  # top_k above the corpus size: all 9 docs
    assert torch.equal(saved["indices"], indices) and torch.equal(saved["scores"], scores)


def test_queries_follow_the_corpus_dtype(files, tmp_path):
    _, D, _ = files
    torch.save(D.to(torch.bfloat16), tmp_path / "d16.pt")
    args = ["retrieve", "--queries", "q.pt", "--corpus", "d16.pt", "--top-k", "2"]
    assert main([*args, "--out", "r.pt"]) == 0
    assert torch.load("r.pt")["scores"].dtype == torch.float32


def test_progress_without_tqdm(files, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # importing tqdm now fails
    main(_retrieve_args("--chunk", "4", "--show", "0"))
    assert "scoring corpus: 3/3 chunks" in capsys.readouterr().err


def _bad_file(tmp_path: Path, name: str, content) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    return name


@pytest.mark.parametrize(
    "role, content, fragments",
    [
        ("corpus", None, ["missing.pt: no such file"]),
        ("corpus", b"not a torch file", ["bad.pt: expected a file written by torch.save"]),
        ("corpus", {"emb": torch.randn(2, 3, 8)}, ["bad.pt", "key 'embeddings'", "['emb']"]),
        ("corpus", [1, 2], ["bad.pt", "got list"]),
        ("corpus", torch.randn(4, 8), ["bad.pt", "[Nd, Ld, d]", "got 2 dims"]),
        ("queries", torch.randn(1, 2, 3, 8), ["bad.pt", "[Nq, Lq, d] or [Lq, d]", "got 4 dims"]),
        ("corpus", torch.randn(2, 5, 6), ["d mismatch", "q.pt has d=8", "bad.pt has d=6"]),
        ("corpus", torch.randn(2, 5, 8).double(), ["bad.pt", "float32", "torch.float64"]),
        (
            "corpus",
            {"embeddings": torch.randn(2, 5, 8), "mask": torch.ones(2, 4, dtype=torch.bool)},
            ["bad.pt", "'mask' must have shape (2, 5)", "got (2, 4)"],
        ),
        (
            "corpus",
            {"embeddings": torch.randn(2, 5, 8), "mask": torch.ones(2, 5)},
            ["bad.pt", "'mask' must be a bool tensor", "torch.float32"],
        ),
    ],
)
def test_bad_input_exits_2_naming_the_file(files, tmp_path, capsys, role, content, fragments):
    name = "missing.pt" if content is None else _bad_file(tmp_path, "bad.pt", content)
    paths = {"queries": "q.pt", "corpus": "d.pt", role: name}
    argv = ["retrieve", "--queries", paths["queries"], "--corpus", paths["corpus"]]
    assert main([*argv, "--top-k", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lik retrieve: error: ")
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


@pytest.mark.parametrize("value", ["0", "-1", "ten"])
def test_top_k_must_be_a_positive_integer(files, capsys, value):
    with pytest.raises(SystemExit) as caught:
        main(["retrieve", "--queries", "q.pt", "--corpus", "d.pt", "--top-k", value])
    assert caught.value.code == 2
    assert "argument --top-k: expected an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [[str(BIN / "lik")], [sys.executable, "-m", "lik"]],
    ids=["console-script", "python-m"],
)
def test_entry_points(command):
    done = subprocess.run([*command, "retrieve", "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--top-k" in done.stdout and "--no-normalize" in done.stdout


def _no_scoring(monkeypatch):
    """Make any scoring fail loudly: the checks below must refuse before it starts."""
    import lik.runtime.retrieval as retrieval

    def refuse(*args, **kwargs):
        raise AssertionError("scored before the arguments were checked")

    monkeypatch.setattr(retrieval, "retrieve", refuse)


@pytest.mark.parametrize(
    "device, fragment",
    [
        ("bogus", "argument --device: 'bogus' is not a device"),
        ("meta", "argument --device: cannot score on 'meta'"),
        *(
            []
            if torch.cuda.is_available()
            else [("cuda", "argument --device: 'cuda', but CUDA is not available here")]
        ),
        *(
            [("cuda:99", "argument --device: 'cuda:99', but this machine has")]
            if torch.cuda.is_available()
            else []
        ),
    ],
)
def test_a_bad_device_exits_2_before_any_file_is_read(files, capsys, monkeypatch, device, fragment):
    _no_scoring(monkeypatch)
    # The query file does not exist: a device check that came after loading would name it.
    argv = ["retrieve", "--queries", "missing.pt", "--corpus", "d.pt", "--top-k", "2"]
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lik retrieve: error: {fragment}"), err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    "out, fragment",
    [
        (".", "argument --out: . is a directory"),
        ("q.pt/results.pt", "argument --out: q.pt/results.pt cannot be created"),
        ("q.pt/deeper/results.pt", "argument --out: q.pt/deeper/results.pt cannot be created"),
    ],
    ids=["a-directory", "under-a-file", "deeper-under-a-file"],
)
def test_a_bad_out_path_exits_2_before_any_scoring(files, capsys, monkeypatch, out, fragment):
    _no_scoring(monkeypatch)
    assert main(_retrieve_args("--out", out)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lik retrieve: error: {fragment}"), err
    assert err.count("\n") == 1, err


def test_an_out_path_in_a_new_directory_is_fine(files):
    assert main(_retrieve_args("--out", "new/deeper/results.pt", "--show", "0")) == 0
    assert Path("new/deeper/results.pt").is_file()


def test_file_errors_name_their_argument(files, capsys):
    argv = ["retrieve", "--queries", "q.pt", "--corpus", "missing.pt", "--top-k", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == "lik retrieve: error: argument --corpus: missing.pt: no such file\n"


def test_an_unknown_family_exits_2_listing_the_known_ones(capsys, monkeypatch):
    import lik.runtime.explain as explain

    def refuse(*args, **kwargs):
        raise AssertionError("planned before --family was checked")

    monkeypatch.setattr(explain, "explain_forward", refuse)
    assert main(["explain", "--shape", "1,10,32,64,128", "--family", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lik explain: error: argument --family: unknown GPU family 'bogus'")
    assert "hopper" in err and err.count("\n") == 1, err
