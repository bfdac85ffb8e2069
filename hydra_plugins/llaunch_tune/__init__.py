"""llaunch's tuning sweeper (launcher/tune_sweeper.py) under the name Hydra accepts: Hydra instantiates
sweepers from the hydra_plugins package only."""
from llaunch.launcher.tune_sweeper import Tuner


class TuneSweeper(Tuner):
    pass
