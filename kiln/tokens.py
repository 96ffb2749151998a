"""Token conventions shared across subsystems (data writes them, the loss and the Hugging Face
conversion read them), kept at the foundation so neither side imports the other."""

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# End-of-document names used by kiln and by common published tokenizers
# (Llama 3, GPT-2, Llama 2 / Mistral), so `kiln prepare` works with them as-is.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "<|endoftext|>", "</s>")
BOS_CANDIDATES = (BOS_TOKEN, "<|begin_of_text|>", "<s>")

# A label the loss ignores: document boundaries under document masking, padding.
IGNORE_INDEX = -100
