"""Training for the zoo (atom_like.zoo): datasets and tokenizer (build_data), the tiny-kimi target
(train_target), EAGLE3 drafts with training-time test (train_eagle3, eagle3_ttt), regeneration
of replies by the target (regenerate), the acceptance evaluation of the plain reference loop
(acceptance, eagle3_reference) and the staged plan ci/train_zoo.sh runs (train_zoo).

Kept out of the serving package: a server or `simple_inference` never imports it. It uses the
engine's packages (atom_like, model_ops), never the other way round."""
