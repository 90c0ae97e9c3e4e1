"""Run by tests/test_recover.py::test_disk_full_during_a_save: one gloo rank saves step 1, then
step 2 with the writer failing as on a full disk (ENOSPC), then loads step 1 again."""
import errno
import json
import os
import sys

import torch
import torch.distributed as dist

from arealite.utils import recover
from arealite.utils.proc import exit_without_teardown

root = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{root}.store", rank=0, world_size=1)


class Engine:
    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)

    def extra_state(self):
        return {}

    def load_extra_state(self, state):
        pass


eng = Engine()
eng.model(torch.ones(2, 4)).sum().backward()
eng.optimizer.step()
saved = {k: v.clone() for k, v in eng.model.state_dict().items()}
recover.save_checkpoint(root, 1, {"actor": eng})
with torch.no_grad():
    eng.model.weight.add_(1.0)


def full_disk(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


real_save = torch.save
torch.save = full_disk
try:
    recover.save_checkpoint(root, 2, {"actor": eng})
    message = None
except OSError as e:
    message = str(e)
torch.save = real_save
complete = recover.list_checkpoints(root)
step = recover.load_checkpoint(complete[-1][1], {"actor": eng})
same = all(torch.equal(saved[k], v) for k, v in eng.model.state_dict().items())
print(json.dumps({"message": message, "complete": [s for s, _ in complete], "loaded_step": step,
                  "params_restored": same, "left": sorted(os.listdir(root))}))
dist.destroy_process_group()
exit_without_teardown()  # results printed, group destroyed: skip finalisation (see its docstring)
