"""Command line: lik-gen generate | check | list [--filter] | explain NAME."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lik-gen", description=__doc__)
    parser.add_argument("--specs", type=Path, default=ROOT / "specs", help="spec directory")
    parser.add_argument("--templates", type=Path, default=ROOT / "templates")
    parser.add_argument("--out", type=Path, default=ROOT / "generated", help="output directory")
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Imported here so --help stays instant.
    from lik_gen.spec import SpecError, load_specs

    try:
        variants = load_specs(args.specs)
    except SpecError as error:
        print(f"lik-gen: spec error: {error}", file=sys.stderr)
        print("nothing was written", file=sys.stderr)
        return 2
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
        if all(_keep(declared.variant, f) for f in args.filter):
            print(declared.variant.name)
    return 0


def _keep(variant, text: str) -> bool:
    if "=" not in text:
        return text in variant.name
    axis, value = text.split("=", 1)
    return str(variant.spec().get(axis)).lower() == value.lower()


def _explain(args, variants) -> int:
    from lik_gen.plan import plan
    from lik_gen.render import environment, templates_used

    match = [d for d in variants if d.variant.name == args.name]
    if not match:
        close = [d.variant.name for d in variants if args.name in d.variant.name][:10]
        print(f"lik-gen: no variant named {args.name!r}", file=sys.stderr)
        if close:
            print("did you mean: " + ", ".join(close), file=sys.stderr)
        return 1
    declared = match[0]
    ctx = plan(declared.variant)
    env = environment(args.templates)
    print(f"variant:   {declared.variant.name}")
    print(f"declared:  family {declared.family!r} in {Path(declared.file).name}")
    print(f"spec:      {json.dumps(declared.variant.spec(), sort_keys=True)}")
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
