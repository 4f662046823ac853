"""The model a run trains: its Hugging Face class built from the recipe (``build``), the attention paths of document
masking (``attention``) and the objective with its chunked loss head (``loss``)."""
