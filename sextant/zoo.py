"""Real model architectures from small configs with random weights: the benchmark set.

Each factory builds a Hugging Face ``transformers`` (or ``diffusers``) model from a small config
— no hub download — and returns ``(module, args)`` ready for ``sextant.compile``. Transformer
models use the library's *default* attention (SDPA), as users run them. Batch 2 and sequence 16
(or 64×64 images) unless said otherwise; ResNet-50 is full size at batch 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _Logits(nn.Module):
    """Call a HF model with keyword inputs and return one tensor (export-friendly output)."""

    def __init__(self, model: nn.Module, field: str, **fixed: object) -> None:
        super().__init__()
        self.model, self.field, self.fixed = model, field, fixed

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(*args, **self.fixed)
        return out[self.field] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def _calibrated(model: nn.Module, *batch: torch.Tensor) -> nn.Module:
    """``model`` in eval mode with unit batch-norm scales and the running statistics of ``batch``.

    Some transformers models draw batch-norm scales from N(0, 0.02): each block then shrinks the
    activations ~50x and the output underflows to (nearly) 0, so a comparison with eager would
    check nothing."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_parameters()
    with torch.no_grad():
        model.train()(*batch)
    return model.eval()


def _seed() -> None:
    torch.manual_seed(0)


def _ids(vocab: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def llama() -> tuple[nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM
    _seed()
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return _Logits(LlamaForCausalLM(cfg).eval(), "logits", use_cache=False), (_ids(1000),)


def gpt2_sdpa() -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel
    _seed()
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128)
    return _Logits(GPT2LMHeadModel(cfg).eval(), "logits", use_cache=False), (_ids(1000),)


def bert() -> tuple[nn.Module, tuple]:
    from transformers import BertConfig, BertModel
    _seed()
    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=512, max_position_embeddings=128)
    return _Logits(BertModel(cfg).eval(), "last_hidden_state"), (_ids(1000),)


def t5() -> tuple[nn.Module, tuple]:
    """Encoder-decoder: T5 with relative position buckets, cross-attention."""
    from transformers import T5Config, T5ForConditionalGeneration
    _seed()
    cfg = T5Config(vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
                   num_heads=4, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(cfg).eval()

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits

    return Seq2Seq(), (_ids(1000), _ids(1000, seq=8))


def swin() -> tuple[nn.Module, tuple]:
    """Vision transformer with shifted-window attention."""
    from transformers import SwinConfig, SwinModel
    _seed()
    cfg = SwinConfig(image_size=64, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4)
    return _Logits(SwinModel(cfg).eval(), "last_hidden_state"), (torch.randn(2, 3, 64, 64),)


def mobilenet_v2() -> tuple[nn.Module, tuple]:
    """Depthwise-separable convs (inverted residuals)."""
    from transformers import MobileNetV2Config, MobileNetV2Model
    _seed()
    cfg = MobileNetV2Config(image_size=64, depth_multiplier=0.5)
    model = _calibrated(MobileNetV2Model(cfg), torch.randn(8, 3, 64, 64))
    return _Logits(model, "last_hidden_state"), (torch.randn(2, 3, 64, 64),)


def convnext() -> tuple[nn.Module, tuple]:
    """7×7 depthwise convs, LayerNorm over channels."""
    from transformers import ConvNextConfig, ConvNextModel
    _seed()
    cfg = ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], image_size=64)
    return _Logits(ConvNextModel(cfg).eval(), "last_hidden_state"), (torch.randn(2, 3, 64, 64),)


def regnet() -> tuple[nn.Module, tuple]:
    """Grouped convs (group width 8) with squeeze-and-excitation."""
    from transformers import RegNetConfig, RegNetModel
    _seed()
    cfg = RegNetConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], groups_width=8, layer_type="y")
    return _Logits(RegNetModel(cfg).eval(), "last_hidden_state"), (torch.randn(2, 3, 64, 64),)


def wav2vec2() -> tuple[nn.Module, tuple]:
    """Audio: a strided 1-D conv front-end (group norm), a conv positional embedding, a transformer."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model
    _seed()
    cfg = Wav2Vec2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                         conv_dim=(64, 64, 64), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    return _Logits(Wav2Vec2Model(cfg).eval(), "last_hidden_state"), (torch.randn(2, 4000),)


def segformer() -> tuple[nn.Module, tuple]:
    """Segmentation: efficient attention with spatial reduction, bilinear upsampling in the head."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation
    _seed()
    cfg = SegformerConfig(num_encoder_blocks=4, depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128],
                          decoder_hidden_size=64, num_labels=8, num_attention_heads=[1, 2, 4, 8])
    return _Logits(SegformerForSemanticSegmentation(cfg).eval(), "logits"), (torch.randn(2, 3, 64, 64),)


def resnet50() -> tuple[nn.Module, tuple]:
    """Full-size ResNet-50 (the default ``ResNetConfig``), batch 1, 64×64."""
    from transformers import ResNetConfig, ResNetModel
    _seed()
    return _Logits(ResNetModel(ResNetConfig()).eval(), "pooler_output"), (torch.randn(1, 3, 64, 64),)


def unet2d() -> tuple[nn.Module, tuple]:
    """diffusers UNet2D: group norm, timestep embedding, down/up sampling, mid-block attention."""
    from diffusers import UNet2DModel
    _seed()
    model = UNet2DModel(sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
                        block_out_channels=(32, 64), norm_num_groups=8,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D")).eval()

    class Denoise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
            return self.model(sample, timestep).sample

    return Denoise(), (torch.randn(2, 3, 32, 32), torch.tensor([10, 500]))


def efficientnet() -> tuple[nn.Module, tuple]:
    """Depthwise convs, squeeze-and-excitation, swish: a deep, branchy graph."""
    from transformers import EfficientNetConfig, EfficientNetModel
    _seed()
    # hidden_dim is the top conv's width, round_filters(1280) at this width: transformers
    # does not derive it from width_coefficient (its 2560 default breaks the top batch norm)
    cfg = EfficientNetConfig(image_size=64, width_coefficient=0.5, depth_coefficient=0.5, hidden_dim=640)
    model = _calibrated(EfficientNetModel(cfg), torch.randn(8, 3, 64, 64))
    return _Logits(model, "last_hidden_state"), (torch.randn(2, 3, 64, 64),)


def mobilevit() -> tuple[nn.Module, tuple]:
    """MobileNet-V2 blocks with transformer blocks over unfolded patches."""
    from transformers import MobileViTConfig, MobileViTModel
    _seed()
    cfg = MobileViTConfig(image_size=64, hidden_sizes=[48, 64, 80], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 160])
    model = _calibrated(MobileViTModel(cfg), torch.randn(8, 3, 64, 64))
    return _Logits(model, "last_hidden_state"), (torch.randn(2, 3, 64, 64),)


def levit() -> tuple[nn.Module, tuple]:
    """Conv stem, attention with learned biases indexed per position pair, subsampling attention."""
    from transformers import LevitConfig, LevitModel
    _seed()
    cfg = LevitConfig(image_size=64, hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4], depths=[1, 1, 1],
                      key_dim=[16, 16, 16])
    model = _calibrated(LevitModel(cfg), torch.randn(8, 3, 64, 64))
    return _Logits(model, "last_hidden_state"), (torch.randn(2, 3, 64, 64),)


def mixtral() -> tuple[nn.Module, tuple]:
    """Mixture of experts: a top-2 router over 4 experts (topk, sort by expert, histc, grouped GEMMs)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    _seed()
    cfg = MixtralConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128)
    return _Logits(MixtralForCausalLM(cfg).eval(), "logits", use_cache=False), (_ids(1000),)


def qwen_moe() -> tuple[nn.Module, tuple]:
    """Mixture of experts with a shared expert and its sigmoid gate (Qwen2-MoE): top-4 of 8 experts."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    _seed()
    cfg = Qwen2MoeConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=4, max_position_embeddings=128)
    return _Logits(Qwen2MoeForCausalLM(cfg).eval(), "logits", use_cache=False), (_ids(1000),)


ZOO: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "llama": llama,
    "gpt2-sdpa": gpt2_sdpa,
    "bert": bert,
    "t5": t5,
    "swin": swin,
    "mobilenet-v2": mobilenet_v2,
    "convnext": convnext,
    "regnet": regnet,
    "efficientnet": efficientnet,
    "wav2vec2": wav2vec2,
    "segformer": segformer,
    "mobilevit": mobilevit,
    "levit": levit,
    "resnet50": resnet50,
    "unet2d": unet2d,
    "mixtral": mixtral,
    "qwen-moe": qwen_moe,
}
