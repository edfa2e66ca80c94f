// Parses PromQL with Prometheus 3's own grammar (the package its web UI uses).
// stdin: a JSON array of expressions; stdout: a JSON array, per expression the offsets of
// every syntax error node (empty when the expression parses).
import { parser } from "@prometheus-io/lezer-promql";

let input = "";
for await (const chunk of process.stdin) input += chunk;
const results = JSON.parse(input).map((expr) => {
  const errors = [];
  parser.parse(expr).iterate({ enter: (node) => { if (node.type.isError) errors.push(node.from); } });
  return errors;
});
process.stdout.write(JSON.stringify(results));
