"""Tiny random Llama and BERT models shared by the calibration and surgery tests (seeded, eval mode)."""
import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM


def tiny_llama(seed=0, tie_word_embeddings=False):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie_word_embeddings)
    return LlamaForCausalLM(cfg).eval()


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=50, hidden_size=20, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=36, max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(cfg).eval()


def token_batches(k=4, seed=0, B=2, T=10, vocab=97):
    """``k`` seeded causal-LM batches of ``B`` sequences of ``T`` random token ids in ``[1, vocab)`` (labels =
    inputs), the calibration / held-out data of the tiny-model tests."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randint(1, vocab, (B, T), generator=g)
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def slow_loss(model, batch):
    """The causal-LM loss after 0.7 s of sleep: a collection slow enough for another process to meet it."""
    import time

    time.sleep(0.7)
    return model(**batch).loss
