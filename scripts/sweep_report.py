#!/usr/bin/env python
"""The sweep report (same as the `llaunch-report` command): python scripts/sweep_report.py SWEEP_DIR [AFTER_DIR]"""
import sys

from llaunch.launcher.report_sweep import main

if __name__ == "__main__":
    sys.exit(main())
