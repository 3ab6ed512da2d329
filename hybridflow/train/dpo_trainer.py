"""`DPOTrainer`: preference optimisation driven from the controller, over one `DPOWorker` group.

The loop is `SFTTrainer`'s (train/sft_trainer.py): each step hands one batch of pairs to the workers, which
compute the reference's log-probs and take one optimizer step on the preference loss of the whole batch;
checkpoints and resumption are the same. Validation runs the loss and its reward metrics on the validation
pairs without gradients: the workers return each row's summed log-probs and the loss is computed here by the
same `dpo_loss` (hybridflow/algos/dpo.py) over the whole set at once.
"""

from __future__ import annotations

import torch

from hybridflow.algos.dpo import PairLogps, dpo_loss
from hybridflow.protocol.future import pad_dataproto_to_divisor, unpad_dataproto
from hybridflow.train.sft_trainer import SFTTrainer
from hybridflow.utils.progress import phase
from hybridflow.workers.dpo import REF_SEQ_LOG_PROB, RESPONSE_TOKENS, SEQ_LOG_PROB


class DPOTrainer(SFTTrainer):
    """Runs the DPO loop over an initialised `DPOWorker` group; `val_history` holds the validation losses."""

    def validate(self) -> dict[str, float]:
        """The preference loss and reward metrics over the whole validation set: {"val/loss", "val/rewards/...",
        "val/logps/..."}."""
        world = self.cfg.world_size
        parts: dict[str, list[torch.Tensor]] = {SEQ_LOG_PROB: [], REF_SEQ_LOG_PROB: [], RESPONSE_TOKENS: []}
        with phase(f"validating ({len(self.val_loader.dataset)} pairs)"):
            for batch in self.val_loader:
                padded, pad = pad_dataproto_to_divisor(batch, world)
                out = unpad_dataproto(self.workers.eval_logps(padded), pad)
                for key, chunks in parts.items():
                    chunks.append(out.batch[key])
        seq, ref, tokens = (torch.cat(parts[k]) for k in (SEQ_LOG_PROB, REF_SEQ_LOG_PROB, RESPONSE_TOKENS))
        logps = PairLogps(seq[0::2], seq[1::2], tokens[0::2], tokens[1::2], ref[0::2], ref[1::2])
        loss, stats = dpo_loss(logps, self.cfg.dpo)
        self.val_history.append(float(loss))
        return {"val/loss": float(loss), **{f"val/{k}": float(v) for k, v in stats.items()}}
