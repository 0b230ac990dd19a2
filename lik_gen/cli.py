"""Command line: lik-gen generate | check | list [--filter] | explain NAME.

lik-gen acts on the checkout it is run in: the nearest directory at or above the working
directory (or --root) that holds lik's pyproject.toml and specs/. Its specs/, templates/
and generated/ are the defaults of --specs, --templates and --out. Outside a checkout,
`list` and `explain` read the specs and templates installed with the package (read-only),
and `generate` and `check` stop: they never write into, or judge, another tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import sys
import time
import tomllib
import urllib.parse
from pathlib import Path

EXIT_USAGE = 2
# A closed pipe (`lik-gen list | head`): the status a shell reports for SIGPIPE.
EXIT_CLOSED_PIPE = 128 + 13


class UsageError(Exception):
    """A bad argument or a missing checkout: one line on stderr, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lik-gen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root",
        type=Path,
        help="the lik checkout to act on (default: found from the working directory)",
    )
    parser.add_argument("--specs", type=Path, help="spec directory (default: ROOT/specs)")
    parser.add_argument(
        "--templates", type=Path, help="template directory (default: ROOT/templates)"
    )
    parser.add_argument("--out", type=Path, help="output directory (default: ROOT/generated)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate", help="render every variant and sync the output directory")
    sub.add_parser("check", help="report missing, stale, orphan and hand-edited files")
    lister = sub.add_parser("list", help="list variant names")
    lister.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="TEXT|AXIS=VALUE",
        help="keep names containing TEXT, or variants whose AXIS equals VALUE (repeatable)",
    )
    explain = sub.add_parser("explain", help="show a variant's spec, plan and templates")
    explain.add_argument("name")
    return parser


def is_checkout(folder: Path) -> bool:
    """A lik source tree: a pyproject.toml naming the project lik, with specs/ beside it."""
    pyproject = folder / "pyproject.toml"
    if not (pyproject.is_file() and (folder / "specs").is_dir()):
        return False
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return project.get("name") == "lik"


def find_checkout(start: Path) -> Path | None:
    """The nearest checkout at or above `start`, or None."""
    start = start.resolve()
    return next((folder for folder in (start, *start.parents) if is_checkout(folder)), None)


def packaged(name: str) -> Path | None:
    """specs/ or templates/ as installed with lik_gen (package data), or None."""
    beside = Path(__file__).resolve().parent / name  # a wheel: lik_gen/specs, lik_gen/templates
    if beside.is_dir():
        return beside
    # An editable install keeps them in the tree it was installed from; PEP 610's
    # direct_url.json names that tree. (A checkout's own lik.egg-info, found first when
    # the working directory is on sys.path, has none: look at every lik distribution.)
    for distribution in importlib.metadata.distributions(name="lik"):
        try:
            record = json.loads(distribution.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        url = record.get("url", "")
        if not (record.get("dir_info", {}).get("editable") and url.startswith("file://")):
            continue
        folder = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)) / name
        if folder.is_dir():
            return folder
    return None


@dataclasses.dataclass(frozen=True)
class Paths:
    specs: Path
    templates: Path
    out: Path | None  # None: no checkout and no --out, so nothing may be written or checked
    where: str  # what the defaults came from, for messages


def resolve_paths(args: argparse.Namespace, cwd: Path) -> Paths:
    """--specs, --templates and --out, each defaulting to the checkout's folder (--root,
    else the one found from cwd), else to the installed package data (no --out then)."""
    if args.root is not None:
        if not is_checkout(args.root):
            raise UsageError(
                f"argument --root: {args.root} is not a lik checkout "
                "(no pyproject.toml for lik with specs/ beside it)"
            )
        root = args.root.resolve()
    else:
        root = find_checkout(cwd)
    if root is not None:
        return Paths(
            args.specs or root / "specs",
            args.templates or root / "templates",
            args.out or root / "generated",
            f"the checkout {root}",
        )
    specs, templates = args.specs or packaged("specs"), args.templates or packaged("templates")
    if specs is None or templates is None:
        missing = "--specs" if specs is None else "--templates"
        raise UsageError(
            f"no lik checkout at or above {cwd} and no installed package data for {missing}: "
            "run lik-gen inside a checkout, or pass --root"
        )
    return Paths(specs, templates, args.out, "the installed package data (read-only)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except UsageError as error:
        print(f"lik-gen {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`lik-gen list | head`): stop quietly. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_CLOSED_PIPE


def _run(args: argparse.Namespace) -> int:
    paths = resolve_paths(args, Path.cwd())
    if args.command in ("generate", "check") and paths.out is None:
        raise UsageError(
            f"no lik checkout at or above {Path.cwd()}: {args.command} acts on a checkout "
            "(run it inside one, or pass --root or --out); the installed package data is "
            "read-only"
        )
    filters = [_parse_filter(text) for text in getattr(args, "filter", [])]
    # Imported here so --help stays instant.
    from lik_gen.spec import SpecError, load_specs

    try:
        variants = load_specs(paths.specs)
    except SpecError as error:
        print(f"lik-gen: spec error: {error}", file=sys.stderr)
        print("nothing was written", file=sys.stderr)
        return 2
    args.specs, args.templates, args.out = paths.specs, paths.templates, paths.out
    args.filters = filters
    return {"generate": _generate, "check": _check, "list": _list, "explain": _explain}[
        args.command
    ](args, variants)


def _generate(args, variants) -> int:
    from lik_gen.render import render_all
    from lik_gen.write import sync

    started = time.perf_counter()
    rendered = render_all(variants, args.templates)
    written, deleted = sync(rendered, args.out)
    for path in written:
        print(f"wrote   {path}")
    for path in deleted:
        print(f"deleted {path}")
    print(
        f"{len(variants)} variants, {len(rendered)} files, {len(written)} written, "
        f"{len(deleted)} deleted in {time.perf_counter() - started:.1f}s"
    )
    return 0


def _check(args, variants) -> int:
    from lik_gen.render import render_all
    from lik_gen.write import check

    report = check(render_all(variants, args.templates), args.out)
    print(report.render(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def _list(args, variants) -> int:
    for declared in variants:
        if all(_keep(declared.variant, f) for f in args.filters):
            print(declared.variant.name)
    return 0


def _spelling(value: object) -> str:
    """A spec value as --filter writes it (true/false for bools)."""
    return str(value).lower()


def _parse_filter(text: str) -> tuple[str | None, str]:
    """--filter TEXT (None, text) or AXIS=VALUE (axis, value); UsageError naming the
    allowed axes or values for an unknown one."""
    if "=" not in text:
        return None, text
    from lik_gen.ir import AXES, allowed_values

    axis, value = (part.strip() for part in text.split("=", 1))
    if axis not in AXES:
        raise UsageError(
            f"argument --filter: unknown axis {axis!r} in {text!r} (axes: {', '.join(AXES)})"
        )
    allowed = [_spelling(v) for v in allowed_values(axis)]
    if value.lower() not in allowed:
        raise UsageError(
            f"argument --filter: {axis} has no value {value!r} (allowed: {', '.join(allowed)})"
        )
    return axis, value.lower()


def _keep(variant, parsed: tuple[str | None, str]) -> bool:
    axis, value = parsed
    if axis is None:
        return value in variant.name
    return _spelling(variant.spec().get(axis)) == value


def _explain(args, variants) -> int:
    from lik_gen.plan import plan
    from lik_gen.render import environment, output_path, templates_used

    match = [d for d in variants if d.variant.name == args.name]
    if not match:
        close = [d.variant.name for d in variants if args.name in d.variant.name][:10]
        print(f"lik-gen: no variant named {args.name!r}", file=sys.stderr)
        if close:
            print("did you mean: " + ", ".join(close), file=sys.stderr)
        return 1
    declared = match[0]
    kernel = declared.variant.kernel
    ctx = plan(kernel)
    env = environment(args.templates)
    print(f"variant:   {declared.variant.name}")
    print(f"declared:  family {declared.family!r} in {Path(declared.file).name}")
    print(f"spec:      {json.dumps(declared.variant.spec(), sort_keys=True)}")
    print(f"kernel:    {kernel.name} (generated/{output_path(kernel)})")
    print(f"values:    {json.dumps(declared.variant.values(), sort_keys=True)} (constexprs)")
    print(f"templates: {', '.join(templates_used(env, ctx.module_template, ctx))}")
    print("plan:")
    for field in dataclasses.fields(ctx):
        value = getattr(ctx, field.name)
        if isinstance(value, tuple) and value and hasattr(value[0], "expr"):
            value = ", ".join(
                getattr(a, "name", "")
                + (f"({', '.join(a.params)}) = {a.expr}" if hasattr(a, "params") else "")
                for a in value
            )
        print(f"  {field.name}: {value}")
    return 0
