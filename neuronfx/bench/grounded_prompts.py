"""Input-grounded tasks for ``neuronfx bench prompt-lookup``: requests whose answer copies long
spans of the prompt (rewrite a paragraph, fix code, extract fields, reformat data), the workload
prompt lookup speculation is for. Written for this benchmark; 24 tasks."""

from __future__ import annotations

_PARAGRAPH = ("The quarterly report shows that revenue grew by twelve percent, driven mostly by the new subscription "
              "plans launched in March. Costs rose as well, because the company hired forty engineers and opened an "
              "office in Lisbon. The board expects growth to continue in the next quarter.")
_EMAIL = ("Hi team, the server migration is moved from Friday to Monday at 9am. Please save your work before Sunday "
          "night, log out of the build machines, and tell Maria if your service needs a manual restart. Thanks, Tom")
_PYTHON = ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(value)\n\n"
           "print(average([1, 2, 3]))")
_JS = ("function greet(name) {\n  const message = 'Hello, ' + name\n  console.log(mesage);\n  return message;\n}\n"
       "greet('Ada');")
_SQL = "SELECT name, age FROM users WHERE age > 30 ORDER BY age DESC LIMIT 10"
_CSV = "name,city,age\nAlice,Paris,34\nBob,Berlin,28\nCarla,Madrid,41\nDavid,Rome,25"
_INVOICE = ("Invoice 2024-117 from Northwind Traders to Contoso Ltd, issued 3 May 2024, due 2 June 2024. Items: 12 "
            "desk lamps at 24.50 each, 3 office chairs at 189.00 each. Total 861.00 EUR.")
_RECIPE = ("Pancakes: mix 200 g flour, 2 eggs, 300 ml milk and a pinch of salt. Rest the batter for 10 minutes. "
           "Heat a pan with butter and cook each pancake for 1 minute per side.")
_LOG = ("2024-05-01 10:02:11 INFO server started on port 8080\n2024-05-01 10:02:15 WARN cache miss for key user:42\n"
        "2024-05-01 10:03:01 ERROR database timeout after 30 s\n2024-05-01 10:03:05 INFO retry succeeded")
_CONFIG = "host: localhost\nport: 5432\nuser: admin\npassword: secret\ndatabase: orders\npool_size: 10"

GROUNDED_TASKS: tuple[str, ...] = (
    f"Rewrite this paragraph in a more formal tone, keeping every fact:\n\n{_PARAGRAPH}",
    f"Repeat this paragraph, fixing any grammar mistakes:\n\n{_PARAGRAPH}",
    f"Rewrite this email so that it is polite and clear, keeping all details:\n\n{_EMAIL}",
    f"Copy this email and add a subject line at the top:\n\n{_EMAIL}",
    f"Fix the bug in this Python code and show the corrected code:\n\n{_PYTHON}",
    f"Add type hints to this Python function and show the whole code:\n\n{_PYTHON}",
    f"Fix the typo in this JavaScript code and show the corrected code:\n\n{_JS}",
    f"Add a semicolon where one is missing in this JavaScript code and show the whole code:\n\n{_JS}",
    f"Rewrite this SQL query with each clause on its own line:\n\n{_SQL}",
    f"Change this SQL query to return 20 rows instead of 10:\n\n{_SQL}",
    f"Convert this CSV to a Markdown table:\n\n{_CSV}",
    f"Convert this CSV to a JSON list of objects:\n\n{_CSV}",
    f"Extract the invoice number, the buyer, the seller, the dates and the total from this text, one per line:\n\n{_INVOICE}",
    f"Rewrite this invoice text as a bulleted list of its items and totals:\n\n{_INVOICE}",
    f"Rewrite this recipe as numbered steps, keeping every quantity:\n\n{_RECIPE}",
    f"List the ingredients of this recipe with their quantities:\n\n{_RECIPE}",
    f"Copy only the ERROR and WARN lines of this log:\n\n{_LOG}",
    f"Rewrite this log with the timestamps removed:\n\n{_LOG}",
    f"Convert this YAML config to JSON:\n\n{_CONFIG}",
    f"Repeat this config, replacing the password with ***:\n\n{_CONFIG}",
    f"Summarize this paragraph in two sentences, quoting its numbers:\n\n{_PARAGRAPH}",
    f"Translate the keys of this config to uppercase and show the whole config:\n\n{_CONFIG}",
    f"Put this email in the third person, keeping everything else the same:\n\n{_EMAIL}",
    f"Rewrite this Python code with a docstring for the function:\n\n{_PYTHON}",
)
