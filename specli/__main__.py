"""`python -m specli` and the `specli` console script: the entry point, which decides what
the process loads before the command line is built."""

import sys


def loads_models(argv: list[str]) -> bool:
    """Whether a command line may load a model. `--version`, `--help` and `CMD --help` print
    without llama.cpp's libraries, as llama.cpp's own programs do at once; `download` reads
    only the hub and the files' headers (a fifth of a second sooner); the auditor of `specli
    audit` (its first process and the one it re-executes) loads no model, and must start
    no thread before it watches (numpy's BLAS starts one). The audited run loads models."""
    if argv == ["--version"] or (len(argv) <= 2 and argv[-1:] in (["--help"], ["-h"])):
        return False
    if argv[:1] == ["audit"]:
        from specli.cli.audit_boot import auditor

        return not auditor()
    return argv[:1] != ["download"]


def main() -> None:
    import gc

    argv = sys.argv[1:]
    if argv == ["--version"]:  # no CLI to build for it
        from specli import __version__

        print(f"specli {__version__}")
        return
    from specli.cli import audit_boot

    audit_boot.early()  # `specli audit`: re-executes here, before the CLI is imported
    if loads_models(argv):
        # llama.cpp's libraries first, before any other native extension brings its own C++
        # runtime: on a CUDA host, sentencepiece (which gguf imports) loaded first made every
        # model load segfault
        from specli import backend  # noqa: F401
    from specli.cli.app import main as app_main

    try:
        app_main()
    finally:
        # the process ends here: the interpreter's last collection would walk every object
        # left (a tenth of a short run's time) to free memory the OS takes back anyway
        gc.freeze()


if __name__ == "__main__":
    main()
