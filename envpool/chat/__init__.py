"""Token-in, token-out chat context: what the model reads, as ids, exactly as its template says.

format.py      `ChatFormat`: whole-conversation ids, and an episode's context built by
               appending ids (never re-tokenizing what the model generated)
templates.py   the model's chat templates, rendered as transformers renders them
"""

from millstream.envpool.chat.format import ChatFormat
from millstream.envpool.chat.templates import ChatTemplateError, load_chat_templates, tokenizer_dir

__all__ = ["ChatFormat", "ChatTemplateError", "load_chat_templates", "tokenizer_dir"]
