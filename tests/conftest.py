"""Suite-wide test settings.

Tests run tiny tensors, where intra-op threading only adds synchronisation cost, and pytest-xdist
already runs one worker per core: each worker uses a single torch thread.
"""

import torch

torch.set_num_threads(1)
