"""What a ``--model`` value names and loading it: registry names, GGUF files, Hugging Face
checkpoints and Hub ids, with their tokenizers and chat templates; a model put on its mesh, or
restored from an orbax checkpoint.

May import: model, sharding, serving.contract, serving.config.
"""
