"""JSON schemas, regexes and choices the structured-output tests run on the real model: nested
objects, arrays, enums, required fields, numbers with ranges. Strings and arrays are bounded
(``maxLength``, ``maxItems``) so a small model's greedy output finishes within the tests'
token budgets; what each output must satisfy is the schema itself (checked by ``jsonschema``).
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "A person with a name and an age.",
        {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]},
    ),
    (
        "Is the sky blue?",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "Pick a primary color.",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
        },
    ),
    (
        "Rate this movie from 1 to 5.",
        {
            "type": "object",
            "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["stars"],
        },
    ),
    (
        "A city and its country.",
        {
            "type": "object",
            "properties": {"city": NAME, "country": NAME},
            "required": ["city", "country"],
        },
    ),
    (
        "List up to three fruits.",
        {
            "type": "object",
            "properties": {"fruits": {"type": "array", "items": NAME, "maxItems": 3}},
            "required": ["fruits"],
        },
    ),
    (
        "A point in 2D.",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -100, "maximum": 100},
                "y": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["x", "y"],
        },
    ),
    (
        "A book with its author (nested).",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "author": {
                    "type": "object",
                    "properties": {"first": NAME, "last": NAME},
                    "required": ["first", "last"],
                },
            },
            "required": ["title", "author"],
        },
    ),
    (
        "The weather today.",
        {
            "type": "object",
            "properties": {
                "sky": {"enum": ["sunny", "cloudy", "rainy"]},
                "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
            },
            "required": ["sky", "celsius"],
        },
    ),
    (
        "Three small numbers.",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "Yes or no?",
        {"enum": ["yes", "no"]},
    ),
    (
        "An order with items and quantities.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "qty"],
                    },
                }
            },
            "required": ["items"],
        },
    ),
    (
        "A user profile with optional nickname.",
        {
            "type": "object",
            "properties": {"user": NAME, "nickname": NAME, "admin": {"type": "boolean"}},
            "required": ["user", "admin"],
        },
    ),
    (
        "A date.",
        {
            "type": "object",
            "properties": {
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                "month": {"type": "integer", "minimum": 1, "maximum": 12},
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
            },
            "required": ["year", "month", "day"],
        },
    ),
    (
        "A traffic light state.",
        {"type": "string", "enum": ["red", "amber", "green"]},
    ),
    (
        "A temperature reading.",
        {
            "type": "object",
            "properties": {
                "value": {"type": "number", "minimum": -50, "maximum": 60},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["value", "unit"],
        },
    ),
    (
        "A pet.",
        {
            "type": "object",
            "properties": {
                "species": {"enum": ["cat", "dog", "fish"]},
                "name": NAME,
                "legs": {"type": "integer", "minimum": 0, "maximum": 4},
            },
            "required": ["species", "name", "legs"],
        },
    ),
    (
        "A team of two people (nested array of objects).",
        {
            "type": "object",
            "properties": {
                "team": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {"name": NAME, "role": {"enum": ["lead", "dev"]}},
                        "required": ["name", "role"],
                    },
                }
            },
            "required": ["team"],
        },
    ),
    (
        "A hex color code.",
        {
            "type": "object",
            "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
            "required": ["hex"],
        },
    ),
    (
        "A product with a price.",
        {
            "type": "object",
            "properties": {
                "product": NAME,
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["product", "price", "in_stock"],
        },
    ),
    (
        "Two tags.",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["a", "b", "c"]},
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["tags"],
        },
    ),
    (
        "A nested config (three levels).",
        {
            "type": "object",
            "properties": {
                "server": {
                    "type": "object",
                    "properties": {
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": {
                            "type": "object",
                            "properties": {"enabled": {"type": "boolean"}},
                            "required": ["enabled"],
                        },
                    },
                    "required": ["port", "tls"],
                }
            },
            "required": ["server"],
        },
    ),
    (
        "An answer or null.",
        {
            "type": "object",
            "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
            "required": ["answer"],
        },
    ),
    (
        "A short greeting.",
        {
            "type": "object",
            "properties": {"greeting": {"type": "string", "maxLength": 20}},
            "required": ["greeting"],
            "additionalProperties": False,
        },
    ),
]

REGEXES: list[tuple[str, str]] = [
    ("A phone number.", r"\d{3}-\d{4}"),
    ("An email address.", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
    ("A time of day.", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("Answer yes or no.", r"(yes|no)"),
    ("A version number.", r"v[0-9]\.[0-9]{1,2}\.[0-9]"),
]

CHOICES: list[tuple[str, list[str]]] = [
    ("What color is grass?", ["red", "green", "blue"]),
    ("Is water wet?", ["yes", "no"]),
    ("Pick a number word.", ["one", "two", "three", "four"]),
    ("Which planet is the largest?", ["Mercury", "Jupiter", "Saturn d'Or", 'He said "hi"']),
]
