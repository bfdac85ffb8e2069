"""llaunch's tuning sweeper (launcher/tune_sweeper.py) under the name Hydra accepts: Hydra instantiates
sweepers from the hydra_plugins package only. Without the tune extra (Optuna) there is none; Hydra
imports every hydra_plugins module at each start, and this one must then import quietly."""
try:
    from llaunch.launcher.tune_sweeper import Tuner
except ImportError:  # `hydra/sweeper=tune` then says to install llaunch[tune] (launcher/main.py)
    pass
else:
    class TuneSweeper(Tuner):
        pass
