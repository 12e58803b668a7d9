"""kvtierd as SGLang's HiCache storage tier: host pages, their daemon layout, the page store, and SGLang's class."""
