"""The torch DeepSeek-V3 and Qwen3-MoE models equal transformers' DeepseekV3ForCausalLM and
Qwen3MoeForCausalLM (fp32, tiny random weights): logits and the gradient of every parameter within
1e-5. Weights go transformers -> save_pretrained -> `ms-llm convert-checkpoint --from hf` -> ours,
so the import is checked too. The multi-token prediction loss is checked against transformers'
own MTP modules; the trainer's step trains it, and the aux-loss-free expert bias, which balances a
skewed router and resumes exactly. Run with -s for the max abs differences and the loads."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ms_llm.checkpoint import Checkpoint, CheckpointWriter, run_config
from ms_llm.checkpoint.interop.hf import export_hf
from ms_llm.checkpoint.reshard import write_full
from ms_llm.cli import main as cli
from ms_llm.config.model import MLAConfig, ModelConfig, MoEConfig
from ms_llm.job import job_from_dict
from ms_llm.machine import Machine
from ms_llm.strategy.plan import plan as make_plan
from torch_backend.apply import apply
from torch_backend.lower import lower
from torch_backend.mesh import build_meshes
from torch_backend.model import Transformer
from torch_backend.moe import MoE
from torch_backend.state import TorchTrainerState
from torch_backend.step import TrainStep

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import MtpModel  # noqa: E402  (transformers 5's DeepSeek-V3 MTP layer)

TOL = 1e-5
DEEPSEEK = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
                qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, num_experts_per_tok=4, first_k_dense_replace=1,
                max_position_embeddings=32, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 0.707, "mscale_all_dim": 1.0}
QWEN3_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=32, rms_norm_eps=1e-6, router_aux_loss_coef=0.0)   # no aux loss in the grads
CASES = {
    # q through the low-rank path, 4 groups of 2 (2 of them kept), interleaved rotary pairs
    "deepseek_v3-q_lora-groups": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": 24, "n_group": 4, "topk_group": 2}),
    # q_proj straight from the hidden state, one group, rotate_half rotary
    "deepseek_v3-q_proj": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": None, "n_group": 1, "topk_group": 1,
                                           "rope_interleave": False}),
    # YaRN with DeepSeek's mscale / mscale_all_dim: cos/sin factor and softmax scale
    "deepseek_v3-yarn": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": 24, "n_group": 2, "topk_group": 1,
                                         "num_experts_per_tok": 2, "rope_parameters": YARN}),
    "qwen3_moe-norm_topk-mlp_only": ("Qwen3Moe", {**QWEN3_MOE, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe-sparse_step2": ("Qwen3Moe", {**QWEN3_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2}),
}


def hf_model(family: str, kwargs: dict):
    """transformers' model with weights spread enough that routing and every norm matter, and
    DeepSeek's expert bias set to random values that change which experts are chosen."""
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(**kwargs)
    hf = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return hf


def imported(hf, tmp_path) -> Transformer:
    """Ours, from transformers' save_pretrained folder through the HF import."""
    hf.save_pretrained(tmp_path / "hub")
    assert cli(["convert-checkpoint", str(tmp_path / "hub"), str(tmp_path / "ckpt"), "--from", "hf"]) == 0
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        ours = Transformer(ckpt.model_config())
        state = ours.state_dict()
        assert set(state) <= set(ckpt.names()), sorted(set(state) - set(ckpt.names()))
        ours.load_state_dict({n: torch.from_numpy(ckpt.read_full(n)) for n in state})
    return ours


def hf_grad(hf_params: dict, name: str) -> torch.Tensor:
    """transformers' gradient of our parameter `name` (its fused gate_up_proj split into gate and up)."""
    if ".mlp.experts." not in name:
        return hf_params[name].grad
    prefix, proj = name.rsplit(".mlp.experts.", 1)
    if proj == "down_proj.weight":
        return hf_params[f"{prefix}.mlp.experts.down_proj"].grad
    gate, up = hf_params[f"{prefix}.mlp.experts.gate_up_proj"].grad.chunk(2, dim=1)
    return gate if proj == "gate_proj.weight" else up


def bias_changes_routing(ours: Transformer, tokens: torch.Tensor) -> bool:
    """Whether some MoE layer picks other experts than it would without its expert bias."""
    changed = []

    def hook(moe, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        with_bias = moe.route(x)[3].sort(-1).values
        saved = moe.expert_bias.clone()
        moe.expert_bias.zero_()
        changed.append(not torch.equal(with_bias, moe.route(x)[3].sort(-1).values))
        moe.expert_bias.copy_(saved)

    handles = [m.register_forward_pre_hook(hook) for m in ours.modules() if hasattr(m, "expert_bias")]
    with torch.no_grad():
        ours(tokens)
    for h in handles:
        h.remove()
    return any(changed)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_grads_match_transformers(tmp_path, case):
    family, kwargs = CASES[case]
    hf = hf_model(family, kwargs)
    ours = imported(hf, tmp_path)
    tokens = torch.randint(0, kwargs["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, kwargs["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    if family == "DeepseekV3":
        assert bias_changes_routing(ours, tokens)
    logits, want = ours(tokens), hf(tokens).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(want.flatten(0, 1), targets.flatten()).backward()
    logit_diff = (logits - want).abs().max().item()
    hf_params = dict(hf.named_parameters())
    grad_diffs = {n: (p.grad - hf_grad(hf_params, n)).abs().max().item() for n, p in ours.named_parameters()}
    grad_diff = max(grad_diffs.values())
    print(f"\n{case} | transformers {family}ForCausalLM | max abs diff logits {logit_diff:.2e} / grads {grad_diff:.2e}")
    assert logit_diff <= TOL and grad_diff <= TOL, (logit_diff, grad_diffs)
    assert len(grad_diffs) == len(hf_params) + sum(".gate_up_proj" in n for n in hf_params)   # every one compared
    assert all(np.isfinite(list(grad_diffs.values())))


TINY_MTP = ModelConfig(
    name="tiny_deepseek_mtp", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
    max_seq_len=32, norm_eps=1e-6, dtype="float32",
    mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12),
    moe=MoEConfig(num_experts=8, top_k=4, expert_ffn_hidden_size=16, shared_experts=1, first_dense_layers=1,
                  score_function="sigmoid", routed_scaling_factor=2.5, num_groups=4, group_top_k=2, expert_bias=True,
                  aux_loss_coeff=0.0),
    mtp_layers=2, mtp_loss_factor=0.3)


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Ours with init_param weights (std 0.15), norms around 1 and a random expert bias."""
    model = Transformer(cfg)
    model.init_weights(seed, std=0.15)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
    return model


def exported(model: Transformer, folder, mtp: bool = True):
    """Our weights as an ms_llm checkpoint, exported to a Hugging Face folder."""
    arrays = {n: (t.detach().numpy().copy(), "float32") for n, t in model.state_dict().items()}
    write_full(arrays, folder / "ckpt", model.cfg)
    return export_hf(folder / "ckpt", folder / "hf", mtp=mtp)


def transformers_mtp(folder, num_layers: int, depths: int):
    """transformers' DeepseekV3ForCausalLM and its MtpModel, read by transformers from the export."""
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(folder).eval()
    # MtpModel finds the MTP tensors by DeepSeek-V3's pattern (model.layers.61); point it at these.
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.({'|'.join(str(num_layers + d) for d in range(depths))})\."]
    return hf, MtpModel.from_pretrained(hf).eval()


def mtp_name(name: str) -> str:
    """transformers' MtpModel name of our model.mtp.{d}.* parameter."""
    d, rest = name.removeprefix("model.mtp.").split(".", 1)
    rest = {"norm.weight": "post_norm.weight"}.get(rest, rest.replace("layer.", "mtp_block.", 1))
    return f"layers.{d}.{rest}"


def test_mtp_loss_and_grads_match_transformers_mtp_modules(tmp_path):
    """Reference: transformers 5 ships DeepSeek-V3's MTP layer (modeling_layers.MtpLayer: enorm,
    hnorm, eh_proj over [embedding, hidden], the decoder layer, post_norm = DeepSeek's
    shared_head.norm) and loads it from DeepSeek's checkpoint names, here our export's
    model.layers.{L + d}.*. Its MtpModel.forward is a drafting loop without the training loss, so
    the loss is composed from its modules as DeepSeek-V3 eq. 21-25 write it: h_0 the main model's
    normed last hidden state, depth k fed by depth k-1's layer output and the embedding of token
    i + k, logits through the shared head after post_norm, cross-entropy against token i + 1 + k
    over the T - k positions that have one, mean over depths times mtp_loss_factor. Depth 1 is
    also checked against MtpLayer.forward itself."""
    ours = random_model(TINY_MTP)
    hf, mtp = transformers_mtp(exported(ours, tmp_path), TINY_MTP.num_layers, TINY_MTP.mtp_layers)
    T = 16
    tokens = torch.randint(0, 96, (2, T), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 96, (2, T), generator=torch.Generator().manual_seed(2))

    # ours: the MTP loss rides on the logits' backward (moe.AuxLoss), the value kept for reporting
    logits = ours(tokens, targets=targets)
    main = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    main.backward()
    ours_mtp = ours.model.mtp.take_aux(1)

    # the reference, from transformers' modules
    positions = torch.arange(T)[None]
    h = hf.model(tokens).last_hidden_state
    emb = hf.model.embed_tokens(tokens)
    rotary = hf.model.rotary_emb(h, positions)
    losses = []
    for k, layer in enumerate(mtp.layers, 1):
        e = F.pad(emb[:, k:], (0, 0, 0, k))
        if k == 1:          # transformers' own MtpLayer.forward returns post_norm(h_1)
            with torch.no_grad():
                want = layer(e, h, position_embeddings=rotary, attention_mask=None, position_ids=positions, cache=None)
                ours_h1 = ours.model.mtp["0"](e, h, ours.rope_cos, ours.rope_sin)
                assert (ours.model.mtp["0"].norm(ours_h1) - want).abs().max().item() <= TOL
        h = layer.mtp_block(layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1)),
                            attention_mask=None, position_embeddings=rotary)
        logits_k = hf.lm_head(layer.post_norm(h))[:, :T - k]
        losses.append(F.cross_entropy(logits_k.flatten(0, 1), targets[:, k:].flatten()))
    want_mtp = TINY_MTP.mtp_loss_factor * torch.stack(losses).mean()
    want_main = F.cross_entropy(hf(tokens).logits.flatten(0, 1), targets.flatten())
    (want_main + want_mtp).backward()

    hf_params, mtp_params = dict(hf.named_parameters()), dict(mtp.named_parameters())
    grads = {}
    for name, p in ours.named_parameters():
        ref = hf_grad(mtp_params, mtp_name(name)) if name.startswith("model.mtp.") else hf_grad(hf_params, name)
        grads[name] = (p.grad - ref).abs().max().item()
    loss_diff = abs(ours_mtp.item() - want_mtp.item())
    grad_diff = max(grads.values())
    print(f"\nmtp (2 depths) | transformers MtpLayer modules, eq. 21-25 | mtp loss {want_mtp.item():.4f}, diff "
          f"{loss_diff:.2e} / grads {grad_diff:.2e}")
    assert abs(main.item() - want_main.item()) <= TOL and loss_diff <= TOL and grad_diff <= TOL, (loss_diff, grads)
    # every MTP parameter compared: theirs less the shared embedding and head, gate_up_proj split in two
    assert sum(n.startswith("model.mtp.") for n in grads) == len(list(mtp.parameters())) - 2 + TINY_MTP.mtp_layers


# ---- training: the torch trainer's step (one process) -------------------------------------------
TRAIN_MODEL = dict(name="tiny_deepseek_train", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                   ffn_hidden_size=48, max_seq_len=16, norm_eps=1e-6, dtype="float32",
                   mla=dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                   moe=dict(num_experts=8, top_k=2, expert_ffn_hidden_size=16, shared_experts=1,
                            score_function="sigmoid", num_groups=4, group_top_k=2, routed_scaling_factor=2.5,
                            expert_bias=True, aux_loss_coeff=0.0))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A gloo world of one (the trainer's collectives), on one thread: tiny ops on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def trainer(rate: float = 0.01, mtp_layers: int = 0, skew: bool = False) -> TrainStep:
    """TrainStep over the torch lowering of TRAIN_MODEL (2 micro-batches of 2 x 16 tokens). `skew`:
    every token embedding shares a direction that the router scores highest for the first experts."""
    model = {**TRAIN_MODEL, "mtp_layers": mtp_layers, "moe": {**TRAIN_MODEL["moe"], "bias_update_rate": rate}}
    job = job_from_dict({"name": "t", "device": "cpu", "model": model,
                         "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
                         "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "steps": 50,
                                   "optimizer": {"name": "adamw", "lr": 1e-4}}})
    plan = make_plan(job.model, job.strategy, job.train, 1)
    low = lower(plan, Machine("cpu"))
    lowered = apply(low, plan, build_meshes(low.mesh, "cpu", low.expert_mesh), torch.device("cpu"), 0)
    if skew:
        with torch.no_grad():
            g = torch.Generator().manual_seed(7)
            v = torch.randn(32, generator=g)
            part = lowered.parts[0]
            part.model.embed_tokens.weight += 0.02 * v
            for m in part.modules():
                if isinstance(m, MoE):
                    m.gate.weight.normal_(0, 0.1, generator=g)
                    m.gate.weight += torch.outer(torch.linspace(0.6, -0.6, 8), v / v.norm())
    return TrainStep(lowered)


def batch(k: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(k))


def imbalance(step: TrainStep, steps: int) -> tuple[list[float], list[str]]:
    """max / mean expert load of each step, and the loads as printed lines."""
    ratios, lines = [], []
    for k in range(steps):
        step(k, batch(k))
        load = step.expert_loads[0]
        ratios.append((load.max() / load.mean()).item())
        lines.append(f"step {k + 1:2d} loads {load.int().tolist()} max/mean {ratios[-1]:.2f}")
    return ratios, lines


def test_expert_bias_balances_a_skewed_router(one_process):
    """Aux-loss-free balancing trains for real: from a router that sends every token to the same
    two experts, the bias update (rate 0.01) brings max/mean load down within 50 steps; at rate 0
    the skew stays."""
    moving, moving_lines = imbalance(trainer(rate=0.01, skew=True), 50)
    still, still_lines = imbalance(trainer(rate=0.0, skew=True), 50)
    report = "\n".join(["bias_update_rate 0.01:", *moving_lines, "bias_update_rate 0:", *still_lines])
    print("\n" + report)
    start, end, end_still = moving[0], sum(moving[-10:]) / 10, sum(still[-10:]) / 10
    assert still[0] == start > 3.0, report                      # the same skewed start, 3x the balanced load
    assert end < 0.6 * start and end_still > 0.9 * start, f"{start:.2f} -> {end:.2f} (rate 0: {end_still:.2f})\n{report}"


def test_expert_bias_is_equal_after_a_checkpoint_resume(one_process, tmp_path):
    """The bias is part of the training state: saved after 3 steps and loaded into a fresh trainer,
    the next 3 steps give the uninterrupted run's losses and biases bit for bit."""
    first = trainer(rate=0.01, skew=True)
    for k in range(3):
        first(k, batch(k))
    plan = first.plan
    state = TorchTrainerState(first, plan, 0)
    held = state.held(create=False)
    biases = [n for n in held if n.endswith("e_score_correction_bias")]
    assert biases == ["model.layers.0.mlp.gate.e_score_correction_bias"] and held[biases[0]][1].abs().sum() > 0
    writer = CheckpointWriter(tmp_path / "ckpt", 0, 1)
    writer.save(3, state.save_items({n: p for n, (p, _) in held.items()}, {n: t for n, (_, t) in held.items()}),
                state={"step": 3}, config=run_config(plan, "torch"))
    writer.close()
    want = [(first(k, batch(k))[0].item(), first.biased[0][1].expert_bias.clone()) for k in range(3, 6)]

    second = trainer(rate=0.01, skew=True)
    resumed = TorchTrainerState(second, plan, 0)
    held = resumed.held(create=True)
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        loaded = resumed.load_into(ckpt, {n: p for n, (p, _) in held.items()}, {n: t for n, (_, t) in held.items()})
    assert biases[0] in loaded
    resumed.set_optimizer_step(3)
    got = [(second(k, batch(k))[0].item(), second.biased[0][1].expert_bias.clone()) for k in range(3, 6)]
    assert [w[0] for w in want] == [g[0] for g in got]
    assert all(torch.equal(w[1], g[1]) for w, g in zip(want, got))


def test_mtp_loss_trains_and_is_reported_apart(one_process):
    """The trainer's loss is the main loss plus the MTP loss, which it also reports; the MTP
    modules get gradients (they move)."""
    step = trainer(mtp_layers=1)
    before = {n: p.detach().clone() for n, p in step.m.parts[0].named_parameters() if ".mtp." in n}
    main = step.evaluate(batch(0)).item()                  # the main loss alone, same weights
    total, _ = step(0, batch(0))
    mtp = step.mtp_loss.item()
    print(f"\nloss {total.item():.5f} = main {main:.5f} + mtp {mtp:.5f}")
    assert 0.2 * main < mtp < 0.4 * main                   # 0.3 x a cross-entropy near the main one, untrained
    assert abs(total.item() - (main + mtp)) < 1e-5
    after = dict(step.m.parts[0].named_parameters())
    assert before and all(not torch.equal(before[n], after[n]) for n in before)


def test_sequence_wise_balance_loss_equals_a_hand_computation():
    """DeepSeek-V3 eq. 17-20 (Megatron's seq_aux_loss) written out in numpy: per sequence,
    f_e = E / (k T) x #tokens routing to e (the bias-steered choice), P_e = mean over the tokens of
    the sigmoid scores normalised per token; the coefficient times the mean over sequences of sum f P."""
    cfg = ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, ffn_hidden_size=12, dtype="float32",
                      moe=MoEConfig(num_experts=4, top_k=2, score_function="sigmoid", expert_bias=True,
                                    aux_loss_coeff=0.0, seq_aux_loss_coeff=0.1))
    torch.manual_seed(1)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(2, 5, 8)
    layer(x)
    scores = 1 / (1 + np.exp(-(x.reshape(-1, 8) @ layer.gate.weight.t()).detach().double().numpy()))   # (10, 4)
    chosen = np.argsort(-(scores + layer.expert_bias.numpy()), axis=1)[:, :2]
    want = 0.0
    for seq in range(2):
        rows = slice(5 * seq, 5 * seq + 5)
        f = np.array([(chosen[rows] == e).sum() for e in range(4)]) * 4 / (2 * 5)
        p = (scores[rows] / scores[rows].sum(1, keepdims=True)).mean(0)
        want += (f * p).sum() / 2
    assert abs(layer.last_aux.item() - 0.1 * want) < 1e-6, (layer.last_aux.item(), 0.1 * want)
