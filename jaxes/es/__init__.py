"""Evolution strategies with keyed in-graph noise (full and low-rank) and staleness-aware updates."""
from jaxes.es.keys import leaf_id, member_key, member_sign, param_name
from jaxes.es.noise import LeafSpec, NoiseConfig
from jaxes.es.noiser import PopulationNoiser
from jaxes.es.schedules import sigma_at
from jaxes.es.shaping import centered_rank, zscore
from jaxes.es.strategy import ESState, Strategy

__all__ = ["ESState", "LeafSpec", "NoiseConfig", "PopulationNoiser", "Strategy", "centered_rank",
           "leaf_id", "member_key", "member_sign", "param_name", "sigma_at", "zscore"]
