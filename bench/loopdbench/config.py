"""``Config``: every setting of one benchmark run, made once from the command line
and passed to whatever needs it (nothing reads a module-level setting).

The fields under "filled in by the run" are set by the main loop as it goes
(start time, output directory, image path, load averages, duration): the report
states them."""

import dataclasses
import datetime
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench")
IMAGE_DIR = "/var/tmp/loopd-bench"
EXPORT = "bench"


@dataclasses.dataclass
class Config:
    runtime: int = 10
    ramp: int = 2
    size: int = 2 << 30
    quick: bool = False
    only: list = dataclasses.field(default_factory=lambda: [1, 2, 3, 4, 5])
    systems: list = dataclasses.field(default_factory=list)
    setup_reps: int = 10
    loopd: str = os.path.join(REPO, "target/release/loopd")
    loopd_given: bool = False
    update_results: bool = False
    image_dir: str = IMAGE_DIR
    command: str = ""
    # Filled in by the run.
    outdir: str = ""
    image: str = ""
    started: datetime.datetime = None
    load_start: str = "?"
    load_end: str = "?"
    elapsed: float = 0.0


@dataclasses.dataclass
class TlsConfig(Config):
    """bench/tls's settings: the rounds, its cases, and the throwaway PKI's paths."""
    rounds: int = 1
    cases: list = dataclasses.field(default_factory=list)
    server_certs: str = ""
    client_home: str = ""
