"""Media inputs of chat requests: image content parts (data URLs and allowed remote URLs),
decoded with Pillow, checked against the limits and preprocessed as the model's processor does.

May import: serving.contract, serving.gateway.http.
"""
