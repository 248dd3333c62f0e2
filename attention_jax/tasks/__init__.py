"""What differs between model families: a `Task` per `config.task` (model, data, loss, and
the optional entries the tools use: sample, decode, embed, attention maps, FLOPs).

The trainer knows nothing about GPT or ViT; it asks `TASKS[config.task]` for a `Task`
and runs it. Each family's adapter reads `config.model` (checked against the model's own
config dataclass) and `config.data` (checked against the adapter's keys), builds the
offline dataset splits and the tokenizer, and returns the loss function. main's modes and
the tools (analysis, viz, fits) ask the Task too, never `isinstance` on a model class: a
family without an entry gets `need`'s one-line error naming the tasks that have it.

    base.py         Task, the registry (register, tasks_with, need) and shared helpers
    text.py         gpt, bert_mlm
    text_classes.py bert_classify
    images.py       vit, cnn
    translation.py  rnn_seq2seq, encdec

A notebook or a test adds a family without editing the package:
`tasks.register("mine", make_my_task, provides=("sample", ...))` (or plainly
`tasks.TASKS["mine"] = make_my_task`, then it is not named in `need`'s errors).
"""

# The families register themselves on import.
from attention_jax.tasks import images, text, text_classes, translation
from attention_jax.tasks.base import (TASKS, AttentionInput, InputTooLongError, Task,
                                      check_model_config, data_on_demand, data_options, declared_for,
                                      describe_readers, lm_vocab_size, model_config, need,
                                      padded_vocab, register, tasks_with, token_labels,
                                      unread_keys, until_eos)
from attention_jax.tasks.images import image_task
from attention_jax.tasks.text import lm_task, mlm_task
from attention_jax.tasks.text_classes import classify_task
from attention_jax.tasks.translation import translation_task

__all__ = ["TASKS", "AttentionInput", "InputTooLongError", "Task", "check_model_config",
           "classify_task",
           "data_on_demand", "declared_for", "describe_readers",
           "data_options", "image_task",
           "lm_task", "lm_vocab_size", "mlm_task", "model_config", "need", "padded_vocab",
           "register", "tasks_with", "token_labels", "translation_task",
           "unread_keys", "until_eos"]
