"""Our torch LLaMA equals transformers' LlamaForCausalLM weight for weight, logit for logit."""
import pytest
import torch

from ms_llm.config.model import ModelConfig
from model_families import FAMILIES, family_config
from torch_backend.model import Transformer

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kv_heads,tied", [(2, False), (4, True)])
def test_logits_match_transformers(kv_heads, tied):
    cfg = ModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                      ffn_hidden_size=160, max_seq_len=32, rope_theta=10000.0, norm_eps=1e-6,
                      tie_embeddings=tied, dtype="float32")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=tied,
        attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    ours = Transformer(cfg).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    assert set(ours.state_dict()) == set(hf.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_init_is_independent_of_module_order():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, max_seq_len=16)
    a, b = Transformer(cfg), Transformer(cfg)
    a.init_weights(7)
    b.init_weights(7)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    a.init_weights(8)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_match_transformers_through_the_exported_config(family):
    """transformers builds the class our exported config.json names; with its random weights
    (biases and q/k norms randomised too) our model gives the same logits."""
    from ms_llm.config.hf import hf_config
    cfg = family_config(family)
    hf_cfg = transformers.AutoConfig.for_model(**hf_config(cfg, "float32"))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    assert type(hf).__name__ == hf_cfg.architectures[0]
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    ours = Transformer(cfg).eval()
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
