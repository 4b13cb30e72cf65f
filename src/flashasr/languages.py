"""ISO 639-1 (and a few ISO 639-2/3) language codes and their English names.

The set is Whisper's language list (the 99 languages of the multilingual models plus
Cantonese, ``yue``, added in large-v3); Parakeet-TDT v3's 25 European languages are a
subset. Codes are ISO 639-1 throughout flashasr: Javanese is ``jv``, which Whisper's vocabulary
spells ``<|jw|>`` (:data:`WHISPER_TOKEN_CODES`; only the Whisper tokenizer translates). OpenAI's
``verbose_json`` transcription response names the language in words (``"english"``), so
:func:`language_name` is what the response renderers use.
"""

from __future__ import annotations

LANGUAGE_NAMES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian", "mk": "macedonian",
    "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian", "ne": "nepali",
    "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili",
    "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer",
    "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan",
    "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi", "gu": "gujarati",
    "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek", "fo": "faroese",
    "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk", "mt": "maltese",
    "sa": "sanskrit", "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan", "tl": "tagalog",
    "mg": "malagasy", "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala",
    "ha": "hausa", "ba": "bashkir", "jv": "javanese", "su": "sundanese", "yue": "cantonese",
}

# Whisper's token spelling where it differs from ISO 639-1 (openai/whisper tokenizer.py: "jw")
WHISPER_TOKEN_CODES: dict[str, str] = {"jv": "jw"}
ISO_OF_WHISPER_TOKEN: dict[str, str] = {w: iso for iso, w in WHISPER_TOKEN_CODES.items()}

# other spellings accepted for a language: Whisper's non-ISO code, and the alias names of
# openai/whisper's TO_LANGUAGE_CODE (besides the names in LANGUAGE_NAMES)
LANGUAGE_ALIASES: dict[str, str] = {
    **ISO_OF_WHISPER_TOKEN,
    "burmese": "my", "valencian": "ca", "flemish": "nl", "haitian": "ht", "letzeburgesch": "lb",
    "pushto": "ps", "panjabi": "pa", "moldavian": "ro", "moldovan": "ro", "sinhalese": "si",
    "castilian": "es", "mandarin": "zh",
}


def language_name(code: str | None) -> str | None:
    """English name for an ISO code (``"en"`` -> ``"english"``); unknown codes are returned
    unchanged, ``None`` stays ``None``."""
    if code is None:
        return None
    return LANGUAGE_NAMES.get(code.lower(), code)
