"""`python -m lidar` entry point; see `lidar.cli`."""

from lidar.cli import main

raise SystemExit(main())
