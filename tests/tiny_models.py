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
