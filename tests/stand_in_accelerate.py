"""An accelerate training loop, unchanged: started by ``accelerate launch`` with a DeepSpeed config file, under
DeepSpeed itself or under ``zero-offload run`` (tests/test_stand_in_scripts.py). Writes {losses, deepspeed's file}
to OUT and the fp32 weights (``deepspeed.utils.safe_get_full_fp32_param``) to OUT.weights.pt on rank 0.

    accelerate launch --use_deepspeed --deepspeed_config_file ds.json tests/stand_in_accelerate.py OUT
"""
import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import build  # noqa: E402
from hf_trainer_runs import TokenData  # noqa: E402
from stand_in_runs import write_out  # noqa: E402


def main(out: str) -> None:
    accelerator = Accelerator()
    model = build("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(TokenData(8 * accelerator.num_processes), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach().clone(), "mean").item())
    write_out(out, losses, accelerator.unwrap_model(model), accelerator.is_main_process,
              skipped=bool(optimizer.step_was_skipped))


if __name__ == "__main__":
    main(sys.argv[1])
