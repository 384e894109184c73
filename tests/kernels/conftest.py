import os

import torch

# Kernels run on the CPU in Triton's interpreter unless a GPU is present.
# Must be set before triton decorates the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
