"""Models people train that remat did not grow up with: Hugging Face architectures built offline from
tiny configs (random weights), and the module structures of the vision libraries written here
(torchvision's wheel does not load beside the CPU torch used here, and timm imports it): ConvNeXt's
channels-last depthwise blocks, MobileNetV3/EfficientNet's squeeze-excitation inverted residuals,
Swin's window attention with a relative-position-index buffer.

Each factory returns (model, example_inputs, loss_fn); the HF ones need transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers as T
except ImportError:  # the tests that need it are skipped
    T = None

VOCAB = 256


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build()


def _ids(batch: int = 4, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _lm(config_cls, model_cls, **cfg):
    model = _seeded(lambda: getattr(T, model_cls)(getattr(T, config_cls)(vocab_size=VOCAB, **cfg)).train())
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}, None


DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def qwen3():
    return _lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=16, **DECODER)


def gemma2():
    return _lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=16, **DECODER)


def phi3():
    return _lm("Phi3Config", "Phi3ForCausalLM", **DECODER)


def gpt_neox():
    return _lm("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)


def distilbert():
    model = _seeded(lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=64)).train())
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}, None


def whisper():
    """Encoder-decoder speech model: log-mel features in, token labels out."""
    cfg = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
               max_source_positions=32, max_target_positions=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
               decoder_start_token_id=0)
    model = _seeded(lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(**cfg)).train())
    feats = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    labels = _ids(4, 16)
    return model, {"input_features": feats, "labels": labels}, None


def clip():
    """Two towers (text, vision) and a contrastive loss."""
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=32)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    model = _seeded(lambda: T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=vision,
                                                     projection_dim=32)).train())
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": _ids(4, 16), "pixel_values": pixels, "return_loss": True}, None


def mamba():
    """State-space model (the pure-torch path)."""
    return _lm("MambaConfig", "MambaForCausalLM", hidden_size=64, state_size=8, num_hidden_layers=2,
               bos_token_id=0, eos_token_id=0, pad_token_id=0)


def lora_qwen2():
    """A peft LoRA adapter (r=4) on Qwen2's attention projections: only the adapters train."""
    import peft

    model, inputs, loss_fn = _lm("Qwen2Config", "Qwen2ForCausalLM", **DECODER)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    return _seeded(lambda: peft.get_peft_model(model, cfg).train()), inputs, loss_fn


def unet2d_condition():
    """diffusers' UNet2DConditionModel (down/up blocks with cross-attention), denoising loss."""
    import diffusers

    model = _seeded(lambda: diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).train())
    g = torch.Generator().manual_seed(1)
    x, text, noise = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 8, 32, generator=g), \
        torch.randn(2, 4, 16, 16, generator=g)
    return model, {"sample": x, "timestep": torch.tensor([10, 500]), "encoder_hidden_states": text}, \
        lambda out: F.mse_loss(out.sample, noise)


# -- structures of the vision libraries ------------------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    """ConvNeXt: 7x7 depthwise conv, LayerNorm over channels (channels-last), MLP, layer scale."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pwconv1 = nn.Linear(c, 4 * c)
        self.pwconv2 = nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 1e-1))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, c: int = 16, depth: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.stages = nn.Sequential(*[ConvNeXtBlock(c) for _ in range(depth)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


def convnext_channels_last():
    """Channels-last weights and activations: a real backward copies convolution weight gradients to
    the weights' layout (``torch.autograd.grad`` does not)."""
    model = _seeded(lambda: ConvNeXt().to(memory_format=torch.channels_last).train())
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1)).to(memory_format=torch.channels_last)
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    return model, (x,), lambda out: F.cross_entropy(out, y)


class SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(c, max(c // 4, 4), 1)
        self.expand = nn.Conv2d(max(c // 4, 4), c, 1)

    def forward(self, x):
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(x.mean((2, 3), keepdim=True)))))


class InvertedResidual(nn.Module):
    """MobileNetV3 / EfficientNet: expand 1x1, depthwise 3x3, squeeze-excitation, project 1x1, BatchNorm."""

    def __init__(self, c: int, expand: int = 4) -> None:
        super().__init__()
        h = c * expand
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), nn.Hardswish())
        self.se = SqueezeExcite(h)
        self.project = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.project(self.se(self.dw(self.expand(x))))


def mobilenet_se():
    model = _seeded(lambda: nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.Hardswish(),
                                          *[InvertedResidual(8) for _ in range(3)],
                                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).train())
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    return model, (x,), lambda out: F.cross_entropy(out, y)


class WindowAttention(nn.Module):
    """Swin: attention inside windows with a learned relative-position bias indexed by a buffer."""

    def __init__(self, d: int, window: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * window - 1) + rel[..., 1])

    def forward(self, x):  # x: (windows, tokens, d)
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias_table[self.relative_position_index.flatten()].reshape(n, n, -1).permute(2, 0, 1)
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5 + bias
        return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class SwinBlock(nn.Module):
    def __init__(self, d: int = 32, window: int = 4) -> None:
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(d)
        self.attn = WindowAttention(d, window)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):  # x: (batch, h, w, d)
        b, h, w, d = x.shape
        s = self.window
        win = self.norm1(x).reshape(b, h // s, s, w // s, s, d).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, d)
        att = self.attn(win).reshape(b, h // s, w // s, s, s, d).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, d)
        x = x + att
        return x + self.mlp(self.norm2(x))


def swin():
    model = _seeded(lambda: nn.Sequential(*[SwinBlock() for _ in range(3)]).train())
    x = torch.randn(4, 16, 16, 32, generator=torch.Generator().manual_seed(1))
    return model, (x,), lambda out: out.square().mean()


class BottleneckD(nn.Module):
    """ResNet-D bottleneck: 1x1, 3x3 (stride), 1x1 with BatchNorm; the shortcut downsamples by average
    pooling then a 1x1 convolution (timm's ``avg_down``)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.AvgPool2d(stride, stride) if stride > 1 else nn.Identity(),
                                            nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        y = F.relu(self.bn2(self.conv2(y)), inplace=True)
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)), inplace=True)


class ResNet26D(nn.Module):
    """timm's resnet26d layout, narrow: a deep stem of three 3x3 convolutions, max pooling, and four
    stages of two ResNet-D bottlenecks each."""

    def __init__(self, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                   nn.Conv2d(width, 2 * width, 3, 1, 1, bias=False))
        self.bn1 = nn.BatchNorm2d(2 * width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, layers = 2 * width, []
        for i, w in enumerate((width, 2 * width, 4 * width, 8 * width)):
            layers.append(nn.Sequential(BottleneckD(cin, w, 1 if i == 0 else 2), BottleneckD(4 * w, w, 1)))
            cin = 4 * w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))


def resnet26d():
    model = _seeded(lambda: ResNet26D().train())
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    return model, (x,), lambda out: F.cross_entropy(out, y)


HF = {"qwen3": qwen3, "gemma2": gemma2, "phi3": phi3, "gpt-neox": gpt_neox, "distilbert": distilbert,
      "whisper": whisper, "clip": clip, "mamba": mamba}
STRUCTURES = {"convnext-channels-last": convnext_channels_last, "mobilenet-se": mobilenet_se, "swin": swin,
              "resnet26d": resnet26d}
#: optional libraries: peft, diffusers (tests skip them with a reason when absent)
EXTRAS = {"peft-lora-qwen2": lora_qwen2, "diffusers-unet2d": unet2d_condition}
THIRD_PARTY = {**(HF if T is not None else {}), **STRUCTURES, **EXTRAS}
