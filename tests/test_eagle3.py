"""EAGLE-3: the published checkpoint format, mismatch errors, lossless chain and tree drafting."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import ALPHA, chi2_pvalue, exact_marginals, small_vocab_target, tiny_model
from transformers import LlamaConfig

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.eagle3_head import Eagle3Head, HeadMismatch
from dynchat.engine.eagle_drafter import Eagle3Drafter, TreeShape
from dynchat.engine.forward import make_lm
from dynchat.engine.policies import Constant, make_policy
from dynchat.engine.sampling import Sampler, SamplingParams
from dynchat.train.eagle3_prompts import _features
from dynchat.train.head_init import new_head
from dynchat.train.ttt import ttt_forward, ttt_loss

PROMPT = [1, 17, 5, 42, 9, 33, 8]
PUBLISHED_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
}


def random_head(target, draft_vocab: int | None = None, seed: int = 1, own_embedding: bool = False) -> Eagle3Head:
    tc = target.config
    vocab = tc.vocab_size
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=tc.hidden_size, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=1, draft_vocab_size=draft_vocab or vocab,
                      max_position_embeddings=256)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, own_embedding=own_embedding)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
        if draft_vocab:
            ids = torch.randperm(vocab)[:draft_vocab].sort().values
            head.d2t.copy_(ids - torch.arange(draft_vocab))
            head.t2d.zero_()
            head.t2d[ids] = True
    return head.eval()


def trained_head(target, steps: int = 150) -> Eagle3Head:
    """A head trained (training-time test) on the target's own greedy text, so drafts get accepted."""
    n_layers = target.config.num_hidden_layers
    for p in target.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = [PROMPT] + [torch.randint(3, 96, (7,), generator=g).tolist() for _ in range(7)]
    seqs = torch.tensor([p + run(Decoder(target), p, 58)[0] for p in prompts])
    vocab = torch.arange(target.config.vocab_size)
    head = new_head(target, vocab, intermediate_size=64)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    feats, logp = _features(target, seqs, head.layer_ids(n_layers), vocab)
    for _ in range(steps):
        loss, *_ = ttt_loss(head, feats, seqs, logp, 4)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target_and_head(request):
    target = tiny_model(request.param, layers=7)
    return request.param, target, trained_head(target)


# -- checkpoint format ------------------------------------------------------------------------------
def test_save_load_round_trip_uses_published_names(tmp_path):
    target = tiny_model("llama", layers=7)
    head = random_head(target, draft_vocab=32)
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    assert set(state) == PUBLISHED_KEYS
    assert state["d2t"].dtype == torch.int64 and state["d2t"].shape == (32,)
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 32
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 32 and cfg["target_hidden_size"] == 32
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    loaded = Eagle3Head.from_pretrained(tmp_path)
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    # draft id i means target id i + d2t[i], and t2d marks exactly those target ids
    mapped = loaded.to_target_ids(torch.arange(32))
    assert loaded.t2d[mapped].all() and mapped.unique().numel() == 32


def test_eagle_repo_style_checkpoint_loads(tmp_path):
    """config.json as the EAGLE authors publish it (LlamaForCausalLM, rope_theta/rope_scaling, fp16,
    pytorch_model.bin, no embedding: the target's is shared)."""
    target = tiny_model("llama", layers=7)
    head = random_head(target)
    state = {k: v.half() if v.is_floating_point() else v for k, v in head.state_dict().items()
             if not k.startswith("rotary_emb.")}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 96,
        "draft_vocab_size": 96, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 256,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_type": "llama3"},
        "torch_dtype": "float16", "tie_word_embeddings": False}))
    loaded = Eagle3Head.from_pretrained(tmp_path)
    assert loaded.embed_tokens is None
    assert torch.allclose(loaded.fc.weight, head.fc.weight, atol=1e-3)
    ref, _ = run(Decoder(target), PROMPT, 30)
    out, _ = run(Decoder(target, Eagle3Drafter(loaded, target)), PROMPT, 30, policy=Constant(3))
    assert out == ref


def test_head_with_own_embedding_round_trips(tmp_path):
    target = tiny_model("qwen3", layers=7)
    head = random_head(target, own_embedding=True)
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "model.safetensors"))) == PUBLISHED_KEYS | {"embed_tokens.weight"}
    assert Eagle3Head.from_pretrained(tmp_path).embed_tokens is not None


def test_reduced_vocabulary_without_d2t_is_refused(tmp_path):
    target = tiny_model("llama", layers=7)
    head = random_head(target, draft_vocab=32)
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    del state["d2t"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadMismatch, match="d2t"):
        Eagle3Head.from_pretrained(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 64, "intermediate_size": 64}, "hidden size 32, the target has 64"),
    ({"vocab_size": 128}, "vocabulary has 96 tokens, the target's 128"),
    ({"num_hidden_layers": 4}, "target has 4 layers"),
])
def test_head_for_another_target_is_refused(change, message):
    from conftest import tiny_config
    from transformers import LlamaForCausalLM

    cfg = tiny_config("llama", layers=7)
    for k, v in change.items():
        setattr(cfg, k, v)
    other = LlamaForCausalLM(cfg)
    head = random_head(tiny_model("llama", layers=7))
    with pytest.raises(HeadMismatch, match=message):
        Eagle3Drafter(head, other)


def test_restricted_vocabulary_keeps_the_heads_scores_and_stays_lossless(target_and_head, tmp_path):
    arch, target, head = target_and_head
    ref, _ = run(Decoder(target), PROMPT, 80)
    keep = torch.tensor(sorted(set(ref) | set(range(3, 30))))         # what the target says, and some more
    small = head.restrict_vocabulary(keep)
    assert small.draft_vocab_size == len(keep) and small.to_target_ids(torch.arange(len(keep))).tolist() == keep.tolist()
    assert small.t2d.sum() == len(keep) and bool(small.t2d[keep].all())
    out = torch.randn(3, head.config.hidden_size)
    torch.testing.assert_close(small.logits(out), head.logits(out)[:, keep])   # full head: draft id i = target id i
    small.save_pretrained(tmp_path)
    loaded = Eagle3Head.from_pretrained(tmp_path)
    assert loaded.draft_vocab_size == len(keep) and torch.equal(loaded.lm_head.weight, small.lm_head.weight)
    ids, s = run(Decoder(target, Eagle3Drafter(loaded, target)), PROMPT, 80, policy=Constant(3))
    assert ids == ref and s.mean_accepted_length > 1.4
    with pytest.raises(ValueError, match="subset"):                  # a reduced head cannot grow back
        small.restrict_vocabulary(torch.tensor([int(t) for t in range(target.config.vocab_size) if t not in keep][:3]))


def test_a_grown_vocabulary_keeps_the_heads_scores_and_scores_new_tokens_with_the_targets_rows(target_and_head):
    """A head trained with lm_head frozen at the target's rows grows its draft vocabulary with more of
    those rows: its own tokens score as before, a new one as the target's output row scores it, and a
    target token it could never draft before becomes draftable (decoding stays lossless)."""
    arch, target, head = target_and_head
    ref, _ = run(Decoder(target), PROMPT, 80)
    vocab = target.config.vocab_size
    small = head.restrict_vocabulary(torch.tensor([t for t in range(3, 30) if t not in set(ref)]))
    grown_ids = torch.tensor(sorted(set(small.to_target_ids(torch.arange(small.draft_vocab_size)).tolist()) | set(ref)))
    rows = head.lm_head.weight.detach().clone()     # the full head's rows stand for the target's output embedding
    assert rows.shape[0] == vocab
    grown = small.extend_vocabulary(grown_ids, rows)
    assert grown.to_target_ids(torch.arange(len(grown_ids))).tolist() == grown_ids.tolist()
    assert bool(grown.t2d[torch.tensor(ref)].all()) and not bool(small.t2d[torch.tensor(ref)].any())
    out = torch.randn(3, head.config.hidden_size)
    own = torch.isin(grown_ids, small.to_target_ids(torch.arange(small.draft_vocab_size)))
    torch.testing.assert_close(grown.logits(out)[:, own], small.logits(out))           # its own rows as trained
    torch.testing.assert_close(grown.logits(out)[:, ~own], grown.norm(out) @ rows[grown_ids[~own]].T)
    _, before = run(Decoder(target, Eagle3Drafter(small, target)), PROMPT, 80, policy=Constant(3))
    ids, after = run(Decoder(target, Eagle3Drafter(grown, target)), PROMPT, 80, policy=Constant(3))
    assert ids == ref and before.accepted_tokens == 0 < after.accepted_tokens
    with pytest.raises(ValueError, match="whole draft vocabulary"):
        small.extend_vocabulary(torch.tensor(ref), rows)



def test_a_widened_mlp_computes_what_the_head_computed_and_its_new_units_learn(target_and_head):
    """Widening a trained head's MLP keeps its drafts (the new units start at zero output), training
    reaches the new units, and a narrower width is refused."""
    arch, target, head = target_and_head
    width = head.config.intermediate_size
    wide = head.widen_mlp(width + 24)
    assert wide.midlayer.mlp.gate_proj.weight.shape[0] == width + 24 == wide.config.intermediate_size
    hidden, attn = torch.randn(2, 5, head.config.hidden_size), torch.randn(2, 5, head.config.hidden_size)
    torch.testing.assert_close(wide.after_attention(hidden, attn), head.after_attention(hidden, attn))
    drafts = [run(Decoder(target, Eagle3Drafter(h, target)), PROMPT, 60, policy=Constant(3)) for h in (head, wide)]
    assert drafts[0][0] == drafts[1][0] and drafts[0][1].accepted_tokens == drafts[1][1].accepted_tokens > 0
    wide.train()
    wide.after_attention(hidden.requires_grad_(), attn).pow(2).sum().backward()
    assert wide.midlayer.mlp.down_proj.weight.grad[:, width:].abs().sum() > 0     # the new units get a gradient
    with pytest.raises(ValueError, match="not narrowed"):
        head.widen_mlp(width - 8)
    half = copy.deepcopy(head).to(torch.bfloat16).widen_mlp(width + 8)      # as heads ship: bf16 weights
    assert half.midlayer.mlp.up_proj.weight.dtype == torch.bfloat16 and half.rotary_emb.inv_freq.dtype == torch.float32

def test_prune_command_keeps_the_most_frequent_tokens(tmp_path):
    from dynchat.cli import main
    from dynchat.train.eagle3_prompts import prune_vocabulary

    target = tiny_model("llama", layers=7)
    head = random_head(target)
    head.save_pretrained(tmp_path / "head")
    (tmp_path / "head" / "README.md").write_text("# card\n")
    work = tmp_path / "work"
    work.mkdir()
    torch.save([[5, 5, 5, 7, 7, 9], [5, 7, 11]], work / "eagle3-data-t0.pt")
    note = prune_vocabulary(tmp_path / "head", tmp_path / "small", work, 2)
    small = Eagle3Head.from_pretrained(tmp_path / "small")
    assert small.to_target_ids(torch.arange(2)).tolist() == [5, 7]
    assert note["coverage"] == pytest.approx(7 / 9)
    assert "pruned" in (tmp_path / "small" / "README.md").read_text()
    assert main(["prune-eagle3-vocab", "--head", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"),
                 "--size", "2"]) == 2


# -- lossless greedy --------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_equals_plain_decoding_with_a_trained_head(target_and_head, tree):
    arch, target, head = target_and_head
    ref, _ = run(Decoder(target), PROMPT, 80)
    drafter = Eagle3Drafter(head, target, TreeShape(4, 4, 20) if tree else None)
    out, s = run(Decoder(target, drafter), PROMPT, 80, policy=Constant(3))
    assert out == ref, f"{arch} {'tree' if tree else 'chain'}"
    assert s.mean_accepted_length > 1.4, "the test head should get drafts accepted, or the paths go untested"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("shape", [(False, 1, 1, 2), (True, 1, 1, 2), (True, 3, 2, 5), (True, 8, 6, 40)])
def test_greedy_lossless_whatever_a_random_head_predicts(arch, draft_vocab, shape):
    tree, top_k, depth, total = shape
    target = tiny_model(arch, layers=7)
    ref, _ = run(Decoder(target), PROMPT, 50)
    drafter = Eagle3Drafter(random_head(target, draft_vocab), target, TreeShape(top_k, depth, total) if tree else None)
    for policy in ("constant", "dynamic"):
        out, _ = run(Decoder(target, drafter), PROMPT, 50, policy=make_policy(policy, 4))
        assert out == ref


class _LateStart(Constant):
    """Drafts nothing for the first `wait` rounds, then `k` a round."""

    def __init__(self, k: int, wait: int):
        super().__init__(k)
        self.wait = wait

    def max_lookahead(self) -> int:
        self.wait -= 1
        return self.k if self.wait < 0 else 0


@pytest.mark.parametrize("wait", [0, 6, 1000])
def test_the_head_reads_the_prompt_only_when_it_first_drafts(target_and_head, wait, monkeypatch):
    """A reply whose rounds never draft with the head runs it not once; one that starts late catches up
    on the prompt and the reply so far in one call, and stays lossless."""
    _, target, head = target_and_head
    ref, _ = run(Decoder(target), PROMPT, 40)
    drafter = Eagle3Drafter(head, target)
    fed = []
    forward = drafter._forward
    monkeypatch.setattr(drafter, "_forward", lambda hidden, tokens, *a: fed.append(tokens.numel()) or
                        forward(hidden, tokens, *a))
    decoder = Decoder(target, drafter)
    out, _ = run(decoder, PROMPT, 40, policy=_LateStart(3, wait))
    assert out == ref
    if wait >= 40:
        assert fed == []
        return
    committed = len(PROMPT) + 1 + wait           # the prefill's token, then `wait` plain steps
    assert fed[0] == committed - 2               # position t pairs g_t with x_{t+1}; the last is the round's
    assert max(fed[1:]) <= 4                     # then a round's accepted tokens, one at a time when drafting


def test_drafting_runs_the_forward_the_head_was_trained_with(target_and_head):
    """The drafter's chain (fused weights, its own KV cache) proposes exactly what the trainer's
    training-time-test forward predicts at that origin: a head learns what it will be asked."""
    _, target, head = target_and_head
    decoder = Decoder(target, Eagle3Drafter(head, target))
    committed = torch.tensor(PROMPT + run(Decoder(target), PROMPT, 12)[0])
    m, k = committed.numel(), 4
    decoder.target.reset()
    decoder.target.forward(committed[:-1])          # as after a round: the last token is not yet fed
    decoder.drafter.reset()
    proposal = decoder.drafter.propose(committed, k, Constant(k), Sampler(SamplingParams(), target.device))
    drafts = proposal.tokens.tolist()
    assert len(drafts) == k
    t = m - 2                                       # the origin: feature g_{m-2} with token x_{m-1}
    features = decoder.target.features[:m - 1].float()
    features = torch.cat([features, features.new_zeros(k, features.shape[1])])[None]   # later ones unused
    tokens = torch.cat([committed, torch.tensor(drafts[:-1])])[None]
    with torch.no_grad():
        trained = [head.to_target_ids(logits[0, t].argmax()).item()
                   for logits in ttt_forward(head, features, tokens, k)]
    assert trained == drafts


def test_chain_on_transformers_modules_matches_lean(target_and_head):
    """Hook-captured features (Transformers modules) equal the lean forward's, so both decode alike."""
    _, target, head = target_and_head
    lean, hf = make_lm(target, "lean"), make_lm(target, "transformers")
    ids = head.layer_ids(target.config.num_hidden_layers)
    lean.capture(ids)
    hf.capture(ids)
    x = torch.tensor(PROMPT + [3, 4, 5])
    lean.forward(x[:6])
    lean.forward(x[6:])
    hf.forward(x[:6])
    hf.forward(x[6:])
    scale = float(hf.features[:10].abs().max())     # equal up to float32 rounding (summation order differs by route)
    assert torch.allclose(lean.features[:10], hf.features[:10], rtol=1e-5, atol=1e-5 * scale)
    outs = [run(Decoder(target, Eagle3Drafter(head, target), backend=b), PROMPT, 40, policy=Constant(3))
            for b in ("lean", "transformers")]
    assert outs[0][0] == outs[1][0]
    assert outs[0][1].accepted_tokens == outs[1][1].accepted_tokens


def test_tree_attention_matches_sequential_forwards():
    """Each tree node's logits equal a plain forward over its own path (mask and positions right)."""
    target = tiny_model("qwen3", layers=7)
    lm = make_lm(target, "lean")
    prefix = torch.tensor(PROMPT)
    tokens = torch.tensor([11, 12, 13, 14, 15])
    parents = [-1, -1, 0, 0, 2]                  # two roots' children; a grandchild; a great-grandchild
    depths = [1, 1, 2, 2, 3]
    mask = torch.eye(6, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i + 1] |= mask[p + 1]
    lm.forward(prefix[:-1])
    tree_logits = lm.forward(torch.cat([prefix[-1:], tokens]), positions=len(PROMPT) - 1 + torch.tensor([0] + depths),
                             tree_mask=mask)
    for i in range(len(tokens)):
        path, a = [], i
        while a >= 0:
            path.insert(0, int(tokens[a]))
            a = parents[a]
        ref = make_lm(target, "lean")
        expected = ref.forward(torch.cat([prefix, torch.tensor(path)]))[-1]
        assert torch.allclose(tree_logits[i + 1], expected, atol=1e-4), f"node {i}"
    # keep the path root -> 0 -> 2 -> 4, then continue: same as a forward over that path
    lm.keep_path(len(PROMPT), torch.tensor([0, 2, 4]) + len(PROMPT))
    nxt = lm.forward(torch.tensor([7]))
    ref = make_lm(target, "lean")
    assert torch.allclose(nxt[-1], ref.forward(torch.tensor(PROMPT + [11, 13, 15, 7]))[-1], atol=1e-4)


def test_tree_near_the_context_limit():
    target = tiny_model("llama", layers=7)
    prompt = (PROMPT * 40)[:240]                 # context 256
    ref, _ = run(Decoder(target), prompt, 50)
    out, s = run(Decoder(target, Eagle3Drafter(random_head(target), target, TreeShape(4, 5, 30))), prompt, 50)
    assert out == ref and s.finish_reason == "context"


# -- lossless sampling ------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)])
def test_tree_verify_follows_the_target(params):
    """Siblings tried in turn with rejected tokens zeroed: the committed token follows p exactly."""
    torch.manual_seed(0)
    V = 10
    logits = torch.randn(4, V) * 1.5
    tokens = torch.tensor([int(logits[0].argmax()), int(logits[0].argsort()[-2]), 3])   # 2 root children, 1 grandchild
    parents = [-1, -1, 0]
    sampler = Sampler(SamplingParams(params.temperature, params.top_p, seed=7), torch.device("cpu"))
    p = sampler.probs(logits)
    firsts, seconds_after_0, accepted = [], [], 0
    for _ in range(12000):
        path, tok, _ = sampler.verify_tree(tokens, parents, logits)
        first = int(tokens[path[0]]) if path else int(tok)
        firsts.append(first)
        accepted += bool(path)
        if path and path[0] == 0:
            seconds_after_0.append(int(tokens[path[1]]) if len(path) > 1 else int(tok))
    assert 0.2 < accepted / 12000 < 0.98
    assert chi2_pvalue(firsts, p[0].numpy()) > ALPHA
    assert chi2_pvalue(seconds_after_0, p[1].numpy()) > ALPHA


@pytest.mark.slow                    # statistical: ~1,500 seeded generations
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampling_end_to_end_matches_target(tree):
    target = small_vocab_target(layers=7, std=0.3)
    head = random_head(target, draft_vocab=8, seed=4)
    with torch.no_grad():
        head.lm_head.weight.mul_(0.2)            # a flat draft: plenty of acceptances and rejections
    prompt = [1, 4, 7]
    params = SamplingParams(0.9)
    expected = exact_marginals(target, prompt, params, depth=3)
    dec = Decoder(target, Eagle3Drafter(head, target, TreeShape(3, 2, 8) if tree else None))
    draws, acc = [], 0
    for i in range(1500):
        ids, s = run(dec, prompt, 3, SamplingParams(0.9, seed=1000 + i), Constant(2))
        draws.append(ids)
        acc += s.accepted_tokens
    assert acc > 200, "drafts must get accepted for the test to mean anything"
    for pos in (1, 2):
        assert chi2_pvalue([d[pos] for d in draws], expected[pos]) > ALPHA, f"position {pos + 1}"


def test_rotary_frequencies_stay_float32_in_a_bf16_head(tmp_path, target_and_head):
    _, _, head = target_and_head
    head.save_pretrained(tmp_path / "h")
    f32 = Eagle3Head.from_pretrained(tmp_path / "h", torch.float32)
    bf16 = Eagle3Head.from_pretrained(tmp_path / "h", torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16
    assert bf16.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.rotary_emb.inv_freq, f32.rotary_emb.inv_freq)
    assert torch.equal(bf16.to(torch.float32).rotary_emb.inv_freq, f32.rotary_emb.inv_freq)


@pytest.mark.parametrize("route", ["int8", "native", "int4", "int4 x int8 activations"])
def test_a_draft_step_in_one_native_call_is_the_pytorch_layer(monkeypatch, route):
    """On the CPU's int8, native and int4 routes (Q4_1 blocks, in float or integer dot products) a
    chain step or catch-up runs the head's layer as one native call (eagle3_layer): the same outputs
    and cache entries as the PyTorch layer, to float rounding, and greedy output still equals plain
    decoding."""
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    target = tiny_model("llama", layers=7)
    head = random_head(target)
    if route.startswith("int4"):          # as an int4 preset marks its head (presets/loading.py)
        head.dynchat_quantization, head.dynchat_int_dot = "int4", route != "int4"
    else:
        monkeypatch.setenv("DYNCHAT_DRAFT_LINEAR", route)
    drafter = Eagle3Drafter(head, target)
    assert drafter.route == route.split()[0] and drafter.native is not None
    if route != "int4 x int8 activations":
        assert int(drafter._flags.sum()) == 0
    else:
        assert drafter._flags.tolist() == [1, 1, 1, 1]      # packed Q4_1 blocks throughout
    drafter.cache.ensure(32)
    torch.manual_seed(3)
    hidden, tokens = torch.randn(3, target.config.hidden_size), torch.tensor([5, 6, 7])
    native, outs, keys = drafter.native, [], []
    for use in (native, None):            # the catch-up of 3 positions (its last row's output), then a step
        drafter.native = use
        first = drafter._forward(hidden, tokens, torch.arange(3), 0, None)
        assert first.shape == (1, target.config.hidden_size)
        step = drafter._forward(first, torch.tensor([9]), torch.tensor([3]), 3, None)
        outs.append(torch.cat([first, step]))
        keys.append(drafter.cache.k[:, :, :4].clone())
    scale = outs[1].abs().max()
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-5 * scale)
    assert torch.allclose(keys[0], keys[1], rtol=0, atol=1e-5 * keys[1].abs().max())
    drafter.native = native
    ref, _ = run(Decoder(target), PROMPT, 50)
    out, s = run(Decoder(target, drafter), PROMPT, 50, policy=Constant(3))
    assert out == ref and s.draft_rounds > 0


@pytest.mark.parametrize("route", ["native", "int8", "int4 x int8 activations"])
@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_a_chain_drafted_in_native_calls_proposes_what_the_pytorch_steps_propose(monkeypatch, route, draft_vocab):
    """Greedy chains on the CPU's native routes run one native call a token (NativeChain: catch-up,
    layer, logits, argmax, confidence): the same drafts as the head's PyTorch-driven steps, the
    policy asked after each token with the same confidence (to float rounding), so the rounds
    stop where they stopped; and the output is plain decoding's."""
    from dynchat.engine.native import library
    from dynchat.engine.policies import Dynamic

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    target = tiny_model("llama", layers=7)
    head = random_head(target, draft_vocab)
    if route.startswith("int4"):
        head.dynchat_quantization, head.dynchat_int_dot = "int4", True
    else:
        monkeypatch.setenv("DYNCHAT_DRAFT_LINEAR", route)
    drafter = Eagle3Drafter(head, target)
    ref, _ = run(Decoder(target), PROMPT, 60)
    asked, outputs, drafts = [], [], []
    propose = drafter.propose

    def recorded(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        drafts[-1].append(proposal.tokens.tolist())
        return proposal

    drafter.propose = recorded
    for fused in (True, False):
        calls = []
        drafts.append([])

        class Recording(Dynamic):
            def keep_drafting(self, drafted, confidence):
                calls.append((drafted, confidence))
                return super().keep_drafting(drafted, confidence)

        decoder = Decoder(target, drafter)
        assert drafter.fused is not None
        if not fused:
            drafter.fused = None
        out, summary = run(decoder, PROMPT, 60, policy=Recording(max_tokens=6, threshold=0.15))
        asked.append(calls)
        outputs.append((out, summary.draft_rounds, summary.draft_tokens, summary.accepted_tokens))
    assert outputs[0] == outputs[1] and outputs[0][0] == ref
    assert drafts[0] == drafts[1] and [d for d, _ in asked[0]] == [d for d, _ in asked[1]]
    assert {len(d) for d in drafts[0]} >= {1, 2, 3}                   # the confidences ended chains at several lengths
    assert torch.allclose(torch.tensor([c for _, c in asked[0]]), torch.tensor([c for _, c in asked[1]]), atol=1e-4)


def test_the_native_layer_stack_captures_the_features_transformers_hooks_capture():
    """decoder_stack copies the captured layers' inputs into the cache's feature rows itself: the same
    rows as Transformers' hooks, through a prefill, a verify and a rollback."""
    from dynchat.engine.lean import LeanLM
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    target = tiny_model("llama", layers=7)
    lean, hf = LeanLM(target, linear="native"), make_lm(target, "transformers")
    assert lean.native is not None
    for lm in (lean, hf):
        lm.capture([1, 3, 5])
        x = torch.tensor(PROMPT + [3, 4, 5, 6])
        lm.forward(x[:6])
        lm.forward(x[6:9])
        lm.rollback(7)
        lm.forward(x[9:11])
    scale = float(hf.features[:9].abs().max())
    assert torch.allclose(lean.features[:9], hf.features[:9], rtol=1e-5, atol=1e-5 * scale)


def test_a_native_draft_step_refuses_a_token_outside_the_embedding(monkeypatch):
    """eagle3_draft checks the ids it embeds before it reads anything (as F.embedding does)."""
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    monkeypatch.setenv("DYNCHAT_DRAFT_LINEAR", "native")
    target = tiny_model("llama", layers=7)
    drafter = Eagle3Drafter(random_head(target), target)
    Decoder(target, drafter)
    assert drafter.fused is not None
    drafter.cache.ensure(8)
    vocab = target.get_input_embeddings().weight.shape[0]
    for bad in (vocab, -1):
        ids = torch.tensor([bad])
        with pytest.raises(IndexError, match="embedding"):
            drafter.fused._call(None, ids.data_ptr(), 1, 0, 0)
    out, _ = run(Decoder(target, drafter), PROMPT, 20, policy=Constant(3))     # and it still drafts
    assert out == run(Decoder(target), PROMPT, 20)[0]


def test_aligned_ttt_trains_a_step_only_where_the_chain_before_it_was_right():
    """GRIFFIN's token alignment: step j's loss counts the origins whose steps 0..j-1 drafted the
    target's top token (where a greedy round can reach step j); the agreement figures still count
    every position, and where the chain is always right nothing changes."""
    target = tiny_model("llama", layers=7)
    head = random_head(target, own_embedding=True)
    g = torch.Generator().manual_seed(3)
    T, V = 12, target.config.vocab_size
    tokens = torch.randint(3, 96, (2, T), generator=g)
    feats = torch.randn(2, T, 3 * target.config.hidden_size, generator=g)
    counted = torch.ones(2, T, dtype=torch.bool)
    counted[:, :3] = False                                       # a prompt: its labels never count
    with torch.no_grad():
        logits = list(ttt_forward(head, feats, tokens, 3))
    picks = logits[0].argmax(-1)                                 # step 0's drafts, origin t -> label t + 1
    logp = torch.log_softmax(torch.randn(2, T, V, generator=g), -1)
    agree = torch.rand(2, T - 1, generator=g) < 0.5              # the target agrees with step 0 at about half
    logp[:, 1:][agree] = torch.log_softmax(10 * torch.nn.functional.one_hot(picks, V).float(), -1)[agree]
    right0 = logp[:, 1:].argmax(-1) == picks
    expected, reached = 0.0, torch.ones(2, T - 1, dtype=torch.bool)
    for j, lg in enumerate(logits):
        keep = counted[:, 1 + j:] & reached[:, :T - 1 - j]
        per = -(logp[:, 1 + j:].exp() * torch.log_softmax(lg, -1)).sum(-1)
        expected += 0.8 ** j * float(per[keep].sum() / max(1, int(keep.sum())))   # none reached: no loss
        right = lg.argmax(-1) == logp[:, 1 + j:].argmax(-1)
        reached = (reached[:, :T - 1 - j] & right & counted[:, 1 + j:])[:, :-1]
    assert 0 < int((right0 & counted[:, 1:]).sum()) < int(counted[:, 1:].sum())   # some chains broke, some held
    with torch.no_grad():
        aligned, accs, _ = ttt_loss(head, feats, tokens, logp, 3, counted, aligned=True)
        plain, plain_accs, _ = ttt_loss(head, feats, tokens, logp, 3, counted)
        one_aligned = ttt_loss(head, feats, tokens, logp, 1, counted, aligned=True)[0]
        one_plain = ttt_loss(head, feats, tokens, logp, 1, counted)[0]
    assert float(aligned) == pytest.approx(expected, rel=1e-5)
    assert float(aligned) != pytest.approx(float(plain), rel=1e-3)
    assert accs == plain_accs
    assert float(one_aligned) == pytest.approx(float(one_plain), rel=1e-6)   # step 0 is always reached
