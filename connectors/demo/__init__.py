"""`kvtierd demo`: the reference runner on a real chat model, with and without kvtierd."""
