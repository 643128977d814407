"""The `PartitionedOptimizerState` face shared by the stage 0-2 and stage 3 optimizers (zero_offload.state)."""
from __future__ import annotations

from typing import Iterable, Iterator

from zero_offload.state import StateChunk
from zero_offload.zero.partitioned_adam import PartitionedAdam

__all__ = ["PartitionStateMixin"]


class PartitionStateMixin:
    """State access for a ZeRO optimizer that keeps its partitions in ``self.adam`` (a `PartitionedAdam`)."""

    adam: PartitionedAdam

    def group_step(self, g: int) -> int:
        return self.adam.group_step(g)

    def state_chunks(self, g: int, chunk_numel: int = 1 << 24) -> Iterator[StateChunk]:
        return self.adam.state_chunks(g, chunk_numel)

    def load_state_chunks(self, g: int, step: int, chunks: Iterable[StateChunk]) -> None:
        self.adam.load_state_chunks(g, step, chunks)

    # Frozen parameters: stage 0-2 hold them whole in the module, where checkpoints read them directly.
    def frozen_shapes(self) -> dict:
        return {}

    def frozen_state(self, every_rank: bool = True) -> dict:
        return {}

    def load_frozen_state(self, values: dict) -> None:
        pass

    def state_format(self) -> str:
        return getattr(self.adam, "state_format", lambda: "adam")()

    def state_dict(self) -> dict:
        """{"partitions": int, "layout": [GroupLayout JSON], "groups": `PartitionedAdam.state_dict` groups}:
        this rank's partitions, loadable by an optimizer of the same layout (checkpoints reshard others)."""
        return {"partitions": self.partitions_count, "layout": [g.to_json() for g in self.layout()],
                **self.adam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s output, then update the 16-bit parameters (a collective at stage >= 1).

        Raises:
            ValueError: state of another layout (other ranks, stage or model).
        """
        if state["partitions"] != self.partitions_count or state["layout"] != [g.to_json() for g in self.layout()]:
            raise ValueError("optimizer state of another partition layout (world size, stage or model); load it "
                             "through a checkpoint, which reshards")
        self.adam.load_state_dict(state)
        self.after_load()
