"""The printed result tables: a title, a column header, a rule, one line a row."""

__all__ = ["print_table"]


def print_table(title, header, lines, out=None):
    """Prints an empty line, the title, the header, a rule as wide as it, and the lines.

    Args:
      title: str, one line saying what was measured and how.
      header: str, the column names padded to the columns' widths.
      lines: iterable of str, one per row, formatted to the same widths.
      out: a text file, or None for stdout.
    """
    print(f"\n{title}", file=out)
    print(header, file=out)
    print("-" * len(header), file=out)
    for line in lines:
        print(line, file=out)
