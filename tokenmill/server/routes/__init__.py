"""The HTTP routes, one router per API: health (operators), openai (models, chat, completions), tokenize."""
