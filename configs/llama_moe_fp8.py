"""A mixture-of-experts Llama with the fp8_rowwise recipe: every block's feed-forward is top-2 of 8 routed experts
plus one shared expert, the experts' grouped GEMMs in fp8 (`qjax.ragged_dot`), the router in float32, and the
load-balancing loss added to the training loss (metric moe_aux_loss). See llama_base.py for the other fields."""

from ml_collections import config_dict

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "fp8_rowwise"
    config.model.moe = config_dict.ConfigDict({
        "n_experts": 8,  # routed experts per block
        "top_k": 2,  # experts each token is routed to
        "n_shared_experts": 1,  # experts every token takes (0: none)
        "expert_ffn_dim": 128,  # SwiGLU hidden width of each expert
        "aux_loss_weight": 0.01,  # weight of the load-balancing loss in the training loss
    })
    return config
