"""Real architectures, built offline from configs with random weights (tiny sizes), plus a
torchvision-style ResNet written here (torchvision cannot be installed beside the CPU torch used here).

Each factory returns (model, example_inputs, loss_fn) with inputs as users pass them.
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


def _ids(batch: int = 4, seq: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                       eos_token_id=0)
    ids = _ids()
    return T.GPT2LMHeadModel(cfg).train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                            "labels": ids}, None


def llama():
    """Grouped-query attention (4 heads, 2 KV heads) and attention dropout."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    ids = _ids()
    return T.LlamaForCausalLM(cfg).train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                             "labels": ids}, None


def mixtral():
    """Mixture of experts: routing makes the graph data-dependent."""
    torch.manual_seed(0)
    cfg = T.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    ids = _ids()
    return T.MixtralForCausalLM(cfg).train(), {"input_ids": ids, "labels": ids}, None


def bert():
    torch.manual_seed(0)
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, max_position_embeddings=64)
    ids = _ids()
    return T.BertForMaskedLM(cfg).train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                            "labels": ids}, None


def vit():
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, num_labels=5)
    g = torch.Generator().manual_seed(1)
    return T.ViTForImageClassification(cfg).train(), {
        "pixel_values": torch.randn(4, 3, 32, 32, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}, None


def t5():
    torch.manual_seed(0)
    cfg = T.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                     num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    g = torch.Generator().manual_seed(1)
    return T.T5ForConditionalGeneration(cfg).train(), {
        "input_ids": torch.randint(2, VOCAB, (4, 32), generator=g),
        "labels": torch.randint(2, VOCAB, (4, 16), generator=g)}, None


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: in-place ReLU, residual add in place, optional downsample."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout (stem, layer1..layer4 of BasicBlocks, pooled head), narrow."""

    def __init__(self, widths=(8, 16, 32, 64), blocks=(2, 2, 2, 2), classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, layers = widths[0], []
        for i, (w, n) in enumerate(zip(widths, blocks)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(*[BasicBlock(cin if j == 0 else w, w, stride if j == 0 else 1)
                                          for j in range(n)]))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, 64, generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    return ResNet().train(), (x,), lambda out: F.cross_entropy(out, y)


HF = {"gpt2": gpt2, "llama": llama, "mixtral": mixtral, "bert": bert, "vit": vit, "t5": t5}
REAL = {**HF, "resnet18": resnet18}
