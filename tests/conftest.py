import os
import sys

import torch

# The spawned ranks import test modules by name; make this folder importable for them.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
