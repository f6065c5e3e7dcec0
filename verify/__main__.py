"""`python -m verify {gate,bisect,fuzz,report,timeline,same,cases}`: the pre-merge numerical gate,
precision-regression bisection (for `git bisect run`), a property-based search for a failing case, the HTML
report of one or more results files, where a run's wall time went per worker, whether two runs found the same,
and which cases of a run took a kernel path (or failed)."""

from __future__ import annotations

import argparse
import importlib
import sys

from verify import devices

# name: (module, exit status of a usage error, summary). Only the chosen command's module is imported:
# gate, bisect and fuzz run checks or kernels (torch, Triton, seconds to import); timeline, report, same and cases
# read results files only (no torch).
COMMANDS = {
    "gate": ("verify.gate", 2, "compare a run with the stored baseline of its device (ratchet)"),
    # exit 2 would mark every commit bad under git bisect run; 128 aborts it (verify.bisect.ABORT)
    "bisect": ("verify.bisect", 128, "judge one commit (or each kernel config) for git bisect run"),
    "fuzz": ("verify.fuzz", 2, "search the fuzzer's families for a failing case with Hypothesis, and shrink it"),
    "report": ("verify.report", 2, "render results files as one self-contained HTML page"),
    "timeline": ("verify.timeline", 2, "where a run's wall time went, per xdist worker"),
    "same": ("verify.same", 2, "whether two runs (or shards against a whole run) found the same, record for record"),
    "cases": ("verify.cases", 2, "the case ids of a run whose records match (a kernel path, a status), for pytest"),
}
NEEDS_TORCH = ("gate", "bisect", "fuzz")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors exit with `error_status`."""

    def __init__(self, *args, error_status: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.error_status = error_status

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(self.error_status, f"{self.prog}: error: {message}\n")


def _chosen(argv: list[str]) -> str | None:
    """The command named on the command line: the first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; the chosen command's module is imported for its arguments, the others
    appear with their summaries."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = _chosen(argv)
    top = Parser(prog="python -m verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}",
                                  parser_class=Parser)
    for name, (module_name, error_status, summary) in COMMANDS.items():
        module = None
        if name == chosen:
            if name in NEEDS_TORCH:
                devices.choose_kernel_runtime()  # bisect --config runs kernels in this process
            module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=summary, description=module.__doc__ if module else summary,
                                  error_status=error_status, formatter_class=argparse.RawDescriptionHelpFormatter)
        if module:
            module.add_arguments(sub)
        sub.set_defaults(module=module, parser=sub)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, unknown = parser(argv).parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, so that bisect's usage errors abort git bisect run
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bisect":
        return args.module.main(args, args.parser)
    return args.module.main(args)


if __name__ == "__main__":
    sys.exit(main())
