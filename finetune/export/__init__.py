"""A finished run turned into what people deploy, each checked before it is kept (a failed check leaves
nothing at --out).

merge        the streaming merge of an adapter into 4-bit-rounded base weights
serving      what vLLM refuses in an adapter
run          the adapter or a merged model, checked against the adapter before it is written
gguf_rope, gguf_file, gguf_spm, gguf_vocab   one GGUF file through llama.cpp's gguf package: rope
             scaling, the tensors, SentencePiece-style and byte-level vocabularies
modelfile    an Ollama Modelfile with the run's chat template
gguf_export  the GGUF export, read back by transformers and checked against the run
"""
