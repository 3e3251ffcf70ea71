"""`python -m flatgrad.bench` / `flatgrad-bench`: FlatGrad against stock PyTorch and DDP,
side by side in one run, with a table, a JSON report and an optional PNG chart."""


def main(argv: list[str] | None = None) -> None:
    """`flatgrad-bench`'s entry point (`flatgrad.bench.cli.main`), imported when called: the
    device report (`python -m flatgrad.bench.device`) needs neither it nor its tqdm."""
    from flatgrad.bench.cli import main as cli_main

    cli_main(argv)


__all__ = ["main"]
