"""TimestepNorm (causal, carried statistics) and the whole-sequence group norm (SPEC §3)."""

from kernels.timestep_norm.reference import group_norm, merge_norm_states, timestep_norm

__all__ = ["timestep_norm", "group_norm", "merge_norm_states"]
