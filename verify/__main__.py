"""`python -m verify {gate,bisect,report,timeline}`: the pre-merge numerical gate, precision-regression
bisection (for `git bisect run`), the HTML report of one or more results files, and where a run's wall time
went per worker."""

from __future__ import annotations

import argparse
import os
import sys

# As verify/session.py: NVML answers whether a GPU exists without initialising CUDA, and on a CPU the Triton
# interpreter must be chosen before anything imports triton (jfa.mask does), for `bisect --config`, which
# runs kernels in this process.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from verify import bisect, gate, report, timeline  # noqa: E402


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors exit with `error_status`."""

    def __init__(self, *args, error_status: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.error_status = error_status

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(self.error_status, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="python -m verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True, metavar="{gate,bisect,report,timeline}",
                                  parser_class=Parser)
    for name, module, error_status, summary in (
        ("gate", gate, 2, "compare a run with the stored baseline of its device (ratchet)"),
        # exit 2 would mark every commit bad under git bisect run; 128 aborts it
        ("bisect", bisect, bisect.ABORT, "judge one commit (or each kernel config) for git bisect run"),
        ("report", report, 2, "render results files as one self-contained HTML page"),
        ("timeline", timeline, 2, "where a run's wall time went, per xdist worker"),
    ):
        sub = commands.add_parser(name, help=summary, description=module.__doc__, error_status=error_status,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(module=module, parser=sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args, unknown = parser().parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, so that bisect's usage errors abort git bisect run
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.module is bisect:
        return bisect.main(args, args.parser)
    return args.module.main(args)


if __name__ == "__main__":
    sys.exit(main())
