"""`verl view RUN_DIR [RUN_DIR ...]`: the run viewer, live on 127.0.0.1 or as one HTML file (`--out`)."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from verl.errors import ViewError
    from verl.utils.console import plain_console
    from verl.view.page import require_plotly
    from verl.view.runs import RUN_FILES, Runs, open_runs

    if args.max_points < 10 or args.last_steps < 0:
        raise ViewError(f"verl view --max-points {args.max_points} --last-steps {args.last_steps}: --max-points keeps "
                        "about that many metric rows (at least 10), --last-steps that many steps (0: all). Fix: "
                        "leave them out for 2000 and 20")
    require_plotly()
    runs = Runs(open_runs(args.run_dirs))
    console = plain_console()
    for r in runs.runs:
        if not any((r.path / name).is_file() for name in RUN_FILES):
            console.print(f"{r.path}: none of {', '.join(RUN_FILES)} yet; the page fills in as the run writes them",
                          highlight=False, markup=False)
    if args.out:
        from verl.view.report import write_report

        path = write_report(runs, args.out, last_steps=args.last_steps, max_points=args.max_points)
        console.print(f"wrote {path} (self-contained: open it in a browser, no network needed)",
                      highlight=False, markup=False)
        return 0
    from verl.view.server import ViewServer

    server = ViewServer(runs, args.port)
    console.print(f"verl view: {server.url}  (Ctrl-C to stop)", highlight=False, markup=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "view", help="See a run in a browser: metrics, samples, episodes, per-token values.",
        description="Serve a page on 127.0.0.1 that shows the runs' metrics (charts by prefix, smoothing, the "
        "best checkpoint, time per stage), validation samples and training rollouts (filter, sort, the same "
        "prompt across steps), multi-turn episodes as transcripts, and tokens coloured by log-prob, entropy, "
        "advantage, ratio or sampler gap. It refreshes while the runs write. With --out, write one "
        "self-contained HTML file instead (plotly embedded, opens without a network).",
        epilog="example: verl view runs/demo runs/demo-1   |   verl view runs/demo --out report.html")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (trainer.run_dir); several "
                        "are overlaid, one colour each")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--out", default=None, metavar="REPORT.html", help="write a self-contained HTML file and exit")
    parser.add_argument("--last-steps", type=int, default=20, metavar="N",
                        help="(--out) keep the last N steps of samples, rollouts and tokens (0: all; default 20)")
    parser.add_argument("--max-points", type=int, default=2000, metavar="N",
                        help="(--out) thin each run's metrics to about N rows (default 2000)")
    parser.set_defaults(func=run)
