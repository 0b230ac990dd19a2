"""The clients' own test suites, plain and with lik's integration enabled.

For each pinned client release below, the tests shipped in its sdist (downloaded from
PyPI by pip, checked against the pinned sha256) run against the installed library three
times, each run recording every test's outcome:

    plain        the suite as its maintainers run it
    enabled      with lik's integration enabled before the suite's modules import
                 (the lik_enabled plugin), on this CPU as a user would run it: lik has no
                 kernel here, so every call reaches a routed twin and goes to the library
    interpreted  the same under TRITON_INTERPRET=1, where lik's generated kernels score
                 what they take

Every test that passes plain must pass enabled, and every other outcome (a test that
fails or is skipped for want of a network, a model from a hub, CUDA or an optional
package) must be the same in both runs. The interpreted run is held to the same rule
except for the tests named in INTERPRETED_DIFFERENCES, each with its reason. Hub access
is off (HF_HUB_OFFLINE=1): tests that need a model or a data set fail at once, in every
run alike, instead of retrying a network that is not there.

    python tests/clients/run_client_suites.py [--cache DIR] [--work DIR] [--client NAME]
    python tests/clients/run_client_suites.py --cache DIR --fetch-only   (setup: download)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Client:
    integration: str  # lik.integrations.<integration>
    requirement: str  # what pip downloads
    sdist: str
    sha256: str
    selection: tuple[str, ...]  # test paths inside the sdist: scoring, similarity, losses
    extract: tuple[str, ...]  # what is taken from the sdist (its tests, a root conftest)


CLIENTS = {
    "pylate": Client(
        integration="pylate",
        requirement="pylate==1.6.0",
        sdist="pylate-1.6.0.tar.gz",
        sha256="fe8aaa649d47f56c2b95183df9b910500f4257cf3c0c7cf353223c48a0059a0c",
        selection=(
            # scoring: ColBERT, the backend switch (lik, flash), XTR
            "tests/test_colbert_scores.py", "tests/test_scores_lik.py",
            "tests/test_scores_flash.py", "tests/test_xtr_scores.py",
            "tests/test_xtr_scoring.py",
            # losses and the model (they load a model or a data set from a hub)
            "tests/test_contrastive.py", "tests/test_cached_contrastive.py",
            "tests/test_kd.py", "tests/test_model.py",
        ),
        extract=("tests", "conftest.py"),
    ),
    "colpali": Client(
        integration="colpali",
        requirement="colpali-engine==0.3.18",
        sdist="colpali_engine-0.3.18.tar.gz",
        sha256="0d7dc57ccb348d4cfe6a63b104857da145fd9783344644399dab798f98347808",
        # scoring (maxsim, score_multi_vector, the LIK backend) and the loss heads
        selection=("tests/utils", "tests/loss"),
        extract=("tests",),
    ),
}

# Tests that the interpreted run may answer otherwise than the plain run, and why.
INTERPRETED_DIFFERENCES = {
    "colpali": {
        f"tests.utils.test_maxsim::test_maxsim_{layout}_matches_einsum_baseline[{dtype}]": (
            "asserts that a CPU call is colpali-engine's fp16/bf16 einsum to atol 2e-2 on "
            "scores of 40 to 70; lik's kernel rounds once from fp32, one half-precision step "
            "(0.03125 fp16, 0.25 bf16) away. On a CPU without the interpreter lik leaves "
            "these calls to the einsum, as colpali-engine's own kernel backend does"
        )
        for layout in ("inbatch", "kd")
        for dtype in ("dtype1", "dtype2")  # torch.float16, torch.bfloat16
    },
}

RUNS = {
    "plain": {},
    "enabled": {"TRITON_INTERPRET": "0"},
    "interpreted": {"TRITON_INTERPRET": "1"},
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(client: Client, cache: Path) -> Path:
    """The pinned sdist, downloaded once into cache and checked against its sha256."""
    path = cache / client.sdist
    if not path.is_file() or _sha256(path) != client.sha256:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", "--dest", str(cache), client.requirement],
            check=True,
        )  # fmt: skip
    got = _sha256(path)
    if got != client.sha256:
        raise SystemExit(f"{client.sdist}: sha256 {got}, pinned {client.sha256}")
    return path


def unpack(client: Client, sdist: Path, work: Path) -> Path:
    """The sdist's tests (not its package: the installed release is what runs)."""
    root = work / client.integration
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        wanted = [f"{top}/{name}" for name in client.extract]
        members = [m for m in archive.getmembers()
                   if any(m.name == w or m.name.startswith(w + "/") for w in wanted)]  # fmt: skip
        for member in members:
            member.name = member.name[len(top) + 1 :]
        archive.extractall(root, members=members, filter="data")
    return root


def run_suite(client: Client, root: Path, run: str) -> tuple[dict[str, str], dict, float]:
    """Outcome per test id, the plugin's counts (enabled runs), and the wall time."""
    report = root / f"{run}.xml"
    counts_file = root / f"{run}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LIK_DISABLE")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               LIK_AUTOTUNE="0", PYTHONDONTWRITEBYTECODE="1")  # fmt: skip
    env.update(RUNS[run])
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", "--rootdir", str(root), *client.selection]  # fmt: skip
    if run != "plain":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        env.update(LIK_CLIENT=client.integration, LIK_CLIENT_REPORT=str(counts_file))
        command[3:3] = ["-p", "lik_enabled"]
    start = time.monotonic()
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if done.returncode not in (0, 1) or not report.is_file():  # 1: some tests failed
        sys.stdout.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{client.requirement} {run}: pytest exited {done.returncode}")
    counts = json.loads(counts_file.read_text()) if counts_file.is_file() else {}
    return outcomes(report), counts, elapsed


def outcomes(report: Path) -> dict[str, str]:
    """'module.path[.Class]::test' -> passed, failed, error or skipped, from junit XML."""
    result = {}
    for case in ET.parse(report).iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = next((kind for kind in ("error", "failure", "skipped") if kind in kinds),
                       "passed")  # fmt: skip
        if outcome == "error" and test_id in result:  # a teardown error after the call
            continue
        result[test_id] = {"failure": "failed"}.get(outcome, outcome)
    return result


def _tally(results: dict[str, str]) -> str:
    order = ("passed", "failed", "error", "skipped")
    counts = {kind: sum(1 for v in results.values() if v == kind) for kind in order}
    return ", ".join(f"{counts[kind]} {kind}" for kind in order)


def compare(plain: dict[str, str], other: dict[str, str], allowed: dict[str, str]) -> list[str]:
    """The problems of `other` against `plain`: a test that passed plain and not here, or
    any other outcome that changed, except the allowed ones."""
    problems = []
    for test_id in sorted(set(plain) | set(other)):
        before, after = plain.get(test_id, "absent"), other.get(test_id, "absent")
        if before != after and test_id not in allowed:
            problems.append(f"{test_id}: {before} plain, {after} here")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lik-sdists")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--client", choices=list(CLIENTS), action="append")
    parser.add_argument("--fetch-only", action="store_true", help="download, run nothing")
    args = parser.parse_args(argv)
    if args.fetch_only:
        for name in args.client or list(CLIENTS):
            print(fetch(CLIENTS[name], args.cache))
        return 0
    if args.work is not None:
        return run_all(args.client or list(CLIENTS), args.cache, args.work)
    with tempfile.TemporaryDirectory(prefix="lik-client-suites-") as work:
        return run_all(args.client or list(CLIENTS), args.cache, Path(work))


def run_all(names: list[str], cache: Path, work: Path) -> int:
    checked = changed = 0
    for name in names:
        client = CLIENTS[name]
        root = unpack(client, fetch(client, cache), work)
        print(f"{client.requirement}: {' '.join(client.selection)}", flush=True)
        results = {}
        for run in RUNS:
            results[run], counts, elapsed = run_suite(client, root, run)
            reach = ""
            if counts:
                reach = (f"; calls reaching a routed twin {counts['reached_a_twin']}, "
                         f"scored by lik {counts['lik_scored']}")  # fmt: skip
            print(f"  {run:<12} {_tally(results[run])} ({elapsed:.0f} s{reach})", flush=True)
            if run == "plain" and "passed" not in results[run].values():
                print("  plain: no test passed (the suite did not run)")
                changed += 1
            if run != "plain" and not counts.get("reached_a_twin"):
                print(f"  {run}: no call reached a routed twin (the integration was not on)")
                changed += 1
        for run in ("enabled", "interpreted"):
            allowed = INTERPRETED_DIFFERENCES.get(name, {}) if run == "interpreted" else {}
            for reason in sorted(set(allowed.values())):
                named = sorted(test_id for test_id, why in allowed.items() if why == reason)
                print(f"  {run}: allowed to differ, as it {reason}:")
                for test_id in named:
                    print(f"    {test_id}: {results['plain'].get(test_id, 'absent')} plain, "
                          f"{results[run].get(test_id, 'absent')} here")
            problems = compare(results["plain"], results[run], allowed)
            for problem in problems:
                print(f"  {run}: CHANGED {problem}")
            changed += len(problems)
        checked += sum(1 for v in results["plain"].values() if v == "passed")
    # Tests that pass plain, and how many outcomes changed in the enabled runs.
    print(f"client suites: {checked} passed, {changed} failed")
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
