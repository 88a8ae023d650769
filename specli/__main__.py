"""`python -m specli` and the `specli` console script."""


def main() -> None:
    import gc
    import sys

    import specli

    if specli.QUICK and sys.argv[1:] == ["--version"]:  # no CLI to build for it
        print(f"specli {specli.__version__}")
        return
    from specli.cli import audit_boot

    audit_boot.early()  # `specli audit`: re-executes here, before the CLI is imported
    from specli.cli.app import main as app_main

    try:
        app_main()
    finally:
        # the process ends here: the interpreter's last collection would walk every object
        # left (a tenth of a short run's time) to free memory the OS takes back anyway
        gc.freeze()


if __name__ == "__main__":
    main()
